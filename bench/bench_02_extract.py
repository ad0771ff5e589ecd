"""Benchmark of step 02: our hidden-state extraction against the naive way, side by side in one run.

Ours: the four needed states captured with hooks on the base model (no logits), samples batched
by length, bf16 files written by background threads. Two references:
- realistic, the way a user writes it: samples batched by length (the same plan as ours, right
  padding with an attention mask), the model in bf16, `output_hidden_states=True`, and only the
  4 needed states of each sample saved in bf16;
- naive: one sample at a time through the causal LM with `output_hidden_states=True` (logits
  over the whole vocabulary included), every layer saved in float32.
All run on the Kimi-style miniature target over the same demo samples; each repeat runs each
way, and the medians are compared. Ratios are printed with three significant digits and goals
are checked on the unrounded values.

Usage:
    python bench/bench_02_extract.py [--samples 200] [--repeats 3] [--batch-tokens 2048] [--threads N]
    python bench/bench_02_extract.py --device cuda:0 --batch-tokens 16384     # on a GPU host

Goal: ours >= 3x the naive tokens per second, and exactly 4 x hidden x 2 bytes of hidden states
per token. Against the realistic reference no goal is set: the figure shows what the hooks and
background writes buy over a careful user's script. Also printed: the share of our wall time
spent in the model's forward pass (at most 100%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.extract.batches import plan_batches
from common.extract.hf_engine import StateExtractor
from common.extract.run import ExtractionRun
from common.miniatures.targets import DEMO_CONVERSATIONS, ensure_target
from common.target.config import load_target_info
from common.target.model import load_text_model


def demo_samples(target: Path, count: int) -> list[list[int]]:
    """The demo conversations through the target's chat template (cycled up to `count`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=True)
    conversations = [json.loads(line)["messages"] for line in DEMO_CONVERSATIONS.read_text().splitlines()]
    return [list(tokenizer.apply_chat_template(conversations[i % len(conversations)], tokenize=True))
            for i in range(count)]


def run_ours(model: torch.nn.Module, layer_ids: list[int], samples: list[list[int]], out: Path,
             batch_tokens: int) -> dict:
    from datasets import Dataset

    ds = Dataset.from_dict({"sample_id": [str(i) for i in range(len(samples))], "input_ids": samples,
                            "loss_mask": [[1] * len(s) for s in samples]})
    lengths = {i: len(s) for i, s in enumerate(samples)}
    run = ExtractionRun(StateExtractor(model, layer_ids), ds, out, show_progress=False)
    stats = run.run(plan_batches(lengths, batch_tokens), set(), lengths)
    return {"seconds": stats.seconds, "file_bytes": stats.file_bytes, "state_bytes": stats.state_bytes,
            "forward_seconds": stats.forward_seconds}


@torch.inference_mode()
def run_naive(model: torch.nn.Module, samples: list[list[int]], out: Path) -> dict:
    start, file_bytes, state_bytes = time.perf_counter(), 0, 0
    device = model.get_input_embeddings().weight.device
    for i, ids in enumerate(samples):
        states = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True).hidden_states
        stacked = torch.stack(states)[:, 0].float().cpu()
        torch.save({"input_ids": torch.tensor(ids), "hidden_states": stacked}, out / f"data_{i}.pt")
        file_bytes += (out / f"data_{i}.pt").stat().st_size
        state_bytes += stacked.numel() * stacked.element_size()
    return {"seconds": time.perf_counter() - start, "file_bytes": file_bytes, "state_bytes": state_bytes}


@torch.inference_mode()
def run_realistic(model: torch.nn.Module, layer_ids: list[int], samples: list[list[int]], out: Path,
                  batch_tokens: int) -> dict:
    """What a careful user writes: length-batched forward passes with `output_hidden_states=True`
    (`model` already in bf16), keeping the three auxiliary states and the last one per sample."""
    start, file_bytes, state_bytes = time.perf_counter(), 0, 0
    device = model.get_input_embeddings().weight.device
    lengths = {i: len(s) for i, s in enumerate(samples)}
    for batch in plan_batches(lengths, batch_tokens):
        longest = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, :lengths[i]] = torch.tensor(samples[i])
            mask[row, :lengths[i]] = 1
        states = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                       logits_to_keep=1).hidden_states
        for row, i in enumerate(batch):
            # clone: a saved view would drag the whole batch's storage into every file
            kept = [states[layer][row, :lengths[i]].to(torch.bfloat16).cpu().clone()
                    for layer in [*layer_ids, len(states) - 1]]
            torch.save({"input_ids": torch.tensor(samples[i]), "hidden_states": kept}, out / f"data_{i}.pt")
            file_bytes += (out / f"data_{i}.pt").stat().st_size
            state_bytes += sum(t.numel() * t.element_size() for t in kept)
    return {"seconds": time.perf_counter() - start, "file_bytes": file_bytes, "state_bytes": state_bytes}


def goal_met(value: float, goal: float) -> str:
    """The goal checked on the unrounded value."""
    return "met" if value >= goal else "NOT met"


def run(samples: int = 200, repeats: int = 3, batch_tokens: int = 2048, target: Path | None = None,
        device: str = "cpu") -> dict:
    """Both ways `repeats` times on the same samples; medians, ratios and bytes per token.
    On a GPU both run in bf16 (the naive way still saves float32), on the CPU in fp32."""
    target = target or ensure_target("kimi")
    info = load_target_info(target, trust_remote_code=True)
    model = load_text_model(info, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32, device=device)
    layer_ids = info.default_layer_ids()
    ids = demo_samples(target, samples)
    tokens = sum(map(len, ids))
    bf16_model = load_text_model(info, dtype=torch.bfloat16, device=device)
    ours, realistic, naive = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
                tempfile.TemporaryDirectory() as c:
            ours.append(run_ours(model, layer_ids, ids, Path(a), batch_tokens))
            realistic.append(run_realistic(bf16_model, layer_ids, ids, Path(c), batch_tokens))
            naive.append(run_naive(model, ids, Path(b)))
    ours_s = statistics.median(r["seconds"] for r in ours)
    realistic_s = statistics.median(r["seconds"] for r in realistic)
    naive_s = statistics.median(r["seconds"] for r in naive)
    result = {
        "target": str(target), "device": device, "samples": samples, "batch_tokens": batch_tokens,
        "tokens": tokens, "repeats": repeats, "threads": torch.get_num_threads(),
        "hidden_size": info.hidden_size, "num_layers": info.num_layers,
        "ours_tokens_per_s": tokens / ours_s, "naive_tokens_per_s": tokens / naive_s, "speedup": naive_s / ours_s,
        "realistic_tokens_per_s": tokens / realistic_s, "speedup_over_realistic": realistic_s / ours_s,
        "realistic_file_bytes_per_token": realistic[0]["file_bytes"] / tokens,
        "ours_state_bytes_per_token": ours[0]["state_bytes"] / tokens,
        "naive_state_bytes_per_token": naive[0]["state_bytes"] / tokens,
        "expected_state_bytes_per_token": 4 * info.hidden_size * 2,
        "ours_file_bytes_per_token": ours[0]["file_bytes"] / tokens,
        "naive_file_bytes_per_token": naive[0]["file_bytes"] / tokens,
        "forward_share": statistics.median(r["forward_seconds"] / r["seconds"] for r in ours),
    }
    result["bytes_ratio"] = result["naive_file_bytes_per_token"] / result["ours_file_bytes_per_token"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="padded tokens per batch (default %(default)s: on a CPU smaller batches run faster)")
    parser.add_argument("--threads", type=int, default=None, help="torch compute threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default: %(default)s)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    r = run(args.samples, args.repeats, args.batch_tokens, device=args.device)
    print(f"{r['samples']} demo samples, {r['tokens']:,} tokens, Kimi-style miniature target "
          f"(hidden {r['hidden_size']}, {r['num_layers']} layers), {r['device']}, {r['threads']} threads, "
          f"batches of {r['batch_tokens']} tokens, median of {r['repeats']}")
    print(f"tokens/s   ours {r['ours_tokens_per_s']:,.0f}  realistic {r['realistic_tokens_per_s']:,.0f}  "
          f"naive {r['naive_tokens_per_s']:,.0f}")
    print(f"           ours/realistic {r['speedup_over_realistic']:#.3g}x (no goal)  "
          f"ours/naive {r['speedup']:#.3g}x (goal >= 3x: {goal_met(r['speedup'], 3.0)})")
    print(f"bytes/tok  ours {r['ours_file_bytes_per_token']:,.0f}  realistic {r['realistic_file_bytes_per_token']:,.0f}  "
          f"naive {r['naive_file_bytes_per_token']:,.0f}  naive/ours {r['bytes_ratio']:#.3g}x (files)")
    print(f"hidden-state bytes/token: ours {r['ours_state_bytes_per_token']:,.0f} "
          f"(4 x {r['hidden_size']} x 2 = {r['expected_state_bytes_per_token']}), "
          f"naive {r['naive_state_bytes_per_token']:,.0f} ({r['num_layers'] + 1} x {r['hidden_size']} x 4)")
    print(f"forward pass: {r['forward_share']:.0%} of our wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
