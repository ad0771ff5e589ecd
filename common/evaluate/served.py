"""05's `--engine vllm`: the served acceptance length of each draft (and plain serving), from
vLLM's own spec-decode counters, on the prompts 05 decoded itself.

vLLM decodes as 05 did: greedy, or sampled at 05's temperature and top-p (request i seeded with
seed + i) with the draft proposing as 05's `draft_sampling` (vLLM's `draft_sample_method`), so the two
acceptance lengths measure the same rule. Sampled outputs are equal to plain vLLM's in distribution
only and are not compared. (vLLM's CPU build samples wrongly with a draft: 05 refuses a temperature
there, see `common.vllm.client.check_sampled_speculation`.)

At temperature 0 each draft's output must equal plain vLLM's token for token (lossless). In fp32
(`--dtype fp32`, possible on a CPU host) it does exactly; in bf16 a near-tie of the target's two
best tokens may break differently between vLLM's batched passes, so for every generation that
differs 05 gives the first differing position and the target's top-2 logit gap there, computed by
05's own target (in its dtype, fp32 on a CPU): a gap under bf16's resolution at that logit
(`bf16_step`) is a near-tie, a larger one points at a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.errors import PipelineError
from common.evaluate.decoding import SamplingParams, input_device
from common.evaluate.prompts import Prompt
from common.evaluate.report import DraftReport, finite
from common.vllm.client import EngineSettings, VllmWorker

BF16_MANTISSA_BITS = 7  # stored bits of bf16's significand: its step at x is 2^(floor(log2|x|) - 7)


@dataclass(frozen=True)
class Divergence:
    """Where one generation with a draft first differs from plain vLLM's."""

    sample_id: str
    position: int  # index in the generated tokens
    plain_token: int
    draft_token: int
    top2_gap: float  # the target's best minus second-best logit after the common prefix
    bf16_step: float  # bf16's resolution at the best logit

    @property
    def near_tie(self) -> bool:
        return self.top2_gap < self.bf16_step

    def figures(self) -> dict[str, Any]:
        return {"sample_id": self.sample_id, "position": self.position, "plain_token": self.plain_token,
                "draft_token": self.draft_token, "top2_logit_gap": finite(self.top2_gap),
                "bf16_step": finite(self.bf16_step), "near_tie": self.near_tie}


@dataclass
class VllmMeasured:
    """One engine run over the prompts: outputs and the spec-decode counters it reported."""

    outputs: list[list[int]]
    seconds: float
    drafts: int = 0  # vllm:spec_decode_num_drafts (verification passes that carried drafts)
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    compared: bool = True  # greedy: outputs compared token by token with plain vLLM's
    mismatched: list[str] = field(default_factory=list)  # sample ids whose output differs from plain vLLM
    divergences: list[Divergence] = field(default_factory=list)  # where each of those first differs

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.drafts if self.drafts else float("nan") for n in self.accepted_per_pos]

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds if self.seconds else float("nan")

    @property
    def differing_share(self) -> float:
        return len(self.mismatched) / len(self.outputs) if self.outputs else 0.0

    def figures(self) -> dict[str, Any]:
        return {"measured_acceptance_length": finite(self.acceptance_length),
                "acceptance_rate_per_position": [finite(r) for r in self.acceptance_rate_per_position],
                "identical_to_greedy": not self.mismatched if self.compared else None,
                "mismatched_samples": self.mismatched,
                "differing_share": finite(self.differing_share) if self.compared else None,
                "divergences": [d.figures() for d in self.divergences],
                "num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted, "num_accepted_tokens_per_pos": self.accepted_per_pos,
                "tokens_per_second": finite(self.tokens_per_second), "outputs": self.outputs}


def _run(python: Path, settings: EngineSettings, prompts: list[list[int]], max_new_tokens: int,
         stop_ids: set[int], sampling: SamplingParams, seed: int) -> VllmMeasured:
    with VllmWorker(python, settings) as worker:
        answer = worker.request({"op": "generate", "prompts": prompts, "max_tokens": max_new_tokens,
                                 "stop_ids": sorted(stop_ids), "temperature": sampling.temperature,
                                 "top_p": sampling.top_p, "seed": seed}, "generation")
    counters = answer["counters"]
    return VllmMeasured(outputs=answer["outputs"], seconds=answer["seconds"], compared=sampling.greedy,
                        drafts=counters["vllm:spec_decode_num_drafts"],
                        draft_tokens=counters["vllm:spec_decode_num_draft_tokens"],
                        accepted=counters["vllm:spec_decode_num_accepted_tokens"],
                        accepted_per_pos=counters["vllm:spec_decode_num_accepted_tokens_per_pos"])


def measure_with_vllm(python: Path, base: EngineSettings, prompts: list[Prompt], drafts: dict[str, Path],
                      ks: list[int], max_new_tokens: int, stop_ids: set[int], target: torch.nn.Module | None = None,
                      sampling: SamplingParams = SamplingParams(), seed: int = 0
                      ) -> tuple[VllmMeasured, dict[str, dict[int, VllmMeasured]]]:
    """Each draft served with the target at each k, then plain vLLM decoding of the prompts, all
    under `sampling`: greedy outputs compared token by token with the plain run, and where one
    differs, with 05's own `target` given, the target's top-2 logit gap there."""
    ids = [p.ids for p in prompts]
    results: dict[str, dict[int, VllmMeasured]] = {}
    for name, folder in drafts.items():  # drafts first: a draft vLLM refuses fails before the plain run
        for k in ks:
            print(f"vLLM: decoding {len(ids)} prompts with {name} ({folder}), k = {k}", flush=True)
            settings = EngineSettings(**{**base.__dict__, "draft": str(folder), "num_speculative_tokens": k,
                                         "draft_sample_method": sampling.draft_sampling})
            result = results.setdefault(name, {})[k] = _run(python, settings, ids, max_new_tokens, stop_ids,
                                                            sampling, seed)
            if result.drafts == 0:
                raise PipelineError(f"vLLM served {name} {folder} but reported no drafts: speculative decoding "
                                    "did not run")
    print(f"vLLM: decoding {len(ids)} prompts without speculation", flush=True)
    plain = _run(python, base, ids, max_new_tokens, stop_ids, sampling, seed)
    if not sampling.greedy:
        return plain, results
    for by_k in results.values():
        for result in by_k.values():
            result.mismatched = [p.sample_id for p, a, b in zip(prompts, result.outputs, plain.outputs) if a != b]
    if target is not None:
        explain_divergences(target, prompts, plain, results)
    return plain, results


@torch.no_grad()
def explain_divergences(target: torch.nn.Module, prompts: list[Prompt], plain: VllmMeasured,
                        served: dict[str, dict[int, VllmMeasured]]) -> None:
    """Fill each served run's `divergences`: for each generation that differs from plain vLLM,
    the first differing position and the target's top-2 logit gap after the common prefix."""
    by_id = {p.sample_id: p for p in prompts}
    index = {p.sample_id: i for i, p in enumerate(prompts)}
    for by_k in served.values():
        for result in by_k.values():
            result.divergences = [_divergence(target, by_id[sid], plain.outputs[index[sid]], result.outputs[index[sid]])
                                  for sid in result.mismatched]


def _divergence(target: torch.nn.Module, prompt: Prompt, plain: list[int], other: list[int]) -> Divergence:
    position = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    ids = torch.tensor([prompt.ids + plain[:position]], device=input_device(target))
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values.tolist()
    step = 2.0 ** (math.floor(math.log2(abs(top[0]))) - BF16_MANTISSA_BITS) if top[0] else 0.0
    return Divergence(prompt.sample_id, position, _token_at(plain, position), _token_at(other, position),
                      top[0] - top[1], step)


def _token_at(tokens: list[int], position: int) -> int:
    return tokens[position] if position < len(tokens) else -1  # -1: that output ended there


def engine_table(names: list[str], own: dict[str, Any], served: dict[str, VllmMeasured],
                 simulated: dict[str, float | None], k: int) -> str:
    """05's own measurement, vLLM's and the simulated figure, one column per (draft, engine)."""
    header = ["", *(f"{n} ({e})" for n in names for e in ("05", "vLLM"))]
    rows: list[list[str]] = []

    def cell(value) -> str:
        if value is None or value != value:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        return f"{value:.3f}" if isinstance(value, float) else f"{value:,}"

    def row(label: str, mine, theirs) -> None:
        rows.append([label, *(cell(v) for n in names for v in (mine(n), theirs(n)))])

    row("acceptance length", lambda n: own[n].stats.acceptance_length if own.get(n) else None,
        lambda n: served[n].acceptance_length)
    for j in range(k):
        row(f"  acceptance rate, draft {j + 1}",
            lambda n, j=j: own[n].stats.acceptance_rate_per_position[j] if own.get(n) else None,
            lambda n, j=j: served[n].acceptance_rate_per_position[j] if j < len(served[n].accepted_per_pos) else None)
    row("verification passes", lambda n: own[n].stats.passes if own.get(n) else None, lambda n: served[n].drafts)
    row("accepted tokens", lambda n: own[n].stats.accepted_total if own.get(n) else None,
        lambda n: served[n].accepted)
    row("identical to greedy", lambda n: own[n].identical_to_greedy if own.get(n) else None,
        lambda n: not served[n].mismatched if served[n].compared else None)
    row("share of outputs differing from plain", lambda n: None,
        lambda n: served[n].differing_share if served[n].compared else None)
    row("  of them near-ties (top-2 gap < bf16 step)", lambda n: None,
        lambda n: sum(d.near_tie for d in served[n].divergences) if served[n].mismatched else None)
    row("simulated acceptance length", lambda n: simulated.get(n), lambda n: None)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def served_lines(reports: list[DraftReport], served: dict[str, dict[int, VllmMeasured]], ks: list[int]) -> list[str]:
    """The engine table at each k, and a line per generation whose output with a draft differs
    from plain vLLM's."""
    names = [r.name for r in reports]
    tables = [engine_table(names, {r.name: r.by_k.get(k) for r in reports}, {n: served[n][k] for n in names},
                           {r.name: (r.offline_at(k) or {}).get("simulated_acceptance_length") for r in reports}, k)
              for k in ks]
    return tables + [f"vLLM {name} k={k}: {d.sample_id} differs from plain vLLM at token {d.position} "
            f"({d.plain_token} vs {d.draft_token}); the target's top-2 logit gap there is {d.top2_gap:.4g} "
            f"({'a near-tie: under' if d.near_tie else 'over'} bf16's step {d.bf16_step:.3g})"
            for name, by_k in served.items() for k, r in by_k.items() for d in r.divergences]
