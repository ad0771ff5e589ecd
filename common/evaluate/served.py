"""05's `--engine vllm`: the served acceptance length of each draft (and plain serving), from
vLLM's own spec-decode counters, on the prompts 05 decoded itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import PipelineError
from common.vllm.client import EngineSettings, VllmWorker


@dataclass
class VllmMeasured:
    """One engine run over the prompts: outputs and the spec-decode counters it reported."""

    outputs: list[list[int]]
    seconds: float
    drafts: int = 0  # vllm:spec_decode_num_drafts (verification passes that carried drafts)
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # sample ids whose output differs from plain vLLM

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.drafts if self.drafts else float("nan") for n in self.accepted_per_pos]

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds if self.seconds else float("nan")

    def figures(self) -> dict[str, Any]:
        return {"measured_acceptance_length": _finite(self.acceptance_length),
                "acceptance_rate_per_position": [_finite(r) for r in self.acceptance_rate_per_position],
                "identical_to_greedy": not self.mismatched, "mismatched_samples": self.mismatched,
                "num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted, "num_accepted_tokens_per_pos": self.accepted_per_pos,
                "tokens_per_second": _finite(self.tokens_per_second), "outputs": self.outputs}


def _finite(x: float) -> float | None:
    return None if x != x else round(float(x), 6)


def _run(python: Path, settings: EngineSettings, prompts: list[list[int]], max_new_tokens: int,
         stop_ids: set[int]) -> VllmMeasured:
    with VllmWorker(python, settings) as worker:
        answer = worker.request({"op": "generate", "prompts": prompts, "max_tokens": max_new_tokens,
                                 "stop_ids": sorted(stop_ids)}, "generation")
    counters = answer["counters"]
    return VllmMeasured(outputs=answer["outputs"], seconds=answer["seconds"],
                        drafts=counters["vllm:spec_decode_num_drafts"],
                        draft_tokens=counters["vllm:spec_decode_num_draft_tokens"],
                        accepted=counters["vllm:spec_decode_num_accepted_tokens"],
                        accepted_per_pos=counters["vllm:spec_decode_num_accepted_tokens_per_pos"])


def measure_with_vllm(python: Path, base: EngineSettings, prompts: list[tuple[str, list[int]]],
                      drafts: dict[str, Path], k: int, max_new_tokens: int,
                      stop_ids: set[int]) -> tuple[VllmMeasured, dict[str, VllmMeasured]]:
    """Plain vLLM greedy decoding of (sample id, prompt ids), then each draft served with the
    target: outputs compared token by token with the plain run (temperature 0)."""
    ids = [p for _, p in prompts]
    results = {}
    for name, folder in drafts.items():  # drafts first: a draft vLLM refuses fails before the plain run
        print(f"vLLM: decoding {len(ids)} prompts with {name} ({folder})", flush=True)
        settings = EngineSettings(**{**base.__dict__, "draft": str(folder), "num_speculative_tokens": k})
        results[name] = _run(python, settings, ids, max_new_tokens, stop_ids)
        if results[name].drafts == 0:
            raise PipelineError(f"vLLM served {name} {folder} but reported no drafts: speculative decoding did not run")
    print(f"vLLM: decoding {len(ids)} prompts without speculation", flush=True)
    plain = _run(python, base, ids, max_new_tokens, stop_ids)
    for result in results.values():
        result.mismatched = [sid for (sid, _), a, b in zip(prompts, result.outputs, plain.outputs) if a != b]
    return plain, results


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
        lambda n: not served[n].mismatched)
    row("simulated acceptance length", lambda n: simulated.get(n), lambda n: None)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
