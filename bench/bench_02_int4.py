"""Benchmark of step 02 on INT4 experts: the same model with its routed experts packed INT4
(as Kimi-K2.5 ships) and in bf16, side by side: tokens/s, peak memory, and the cost of
dequantizing the packed experts inside every call.

The default miniature is dominated by its 163840-word embeddings, so this benchmark writes a
variant where the experts dominate the weights (256 routed experts of 128 x 512, 8 active, as
many as Kimi-K2.5 activates): 69% of its INT4 checkpoint and 89% of its bf16 one are experts
(Kimi-K2.5: 96% and 99%). Each variant runs in a fresh process and reads its resident set size
(VmRSS/VmHWM, reset between phases): the peak while loading (weights plus the shard being read),
and the peak of the extraction above the loaded model (activations of `--batch-tokens`, files in
flight, allocator slack, and for INT4 the per-call dequantized expert). Both compute in bf16, as
on a GPU, over the same batches, so what the INT4 run takes above the bf16 run is charged to its
weights: peak weight memory = INT4 loading peak (at least its tensor bytes) + max(0, INT4 run
peak - bf16 run peak).

Usage:
    python bench/bench_02_int4.py [--samples 40] [--batch-tokens 1024] [--threads N]

Goal: that peak weight memory <= 1.15x the packed checkpoint (language-model tensors) on disk, and
the expert bytes in memory after the run equal to the packed bytes on disk (nothing cached).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.defaults import MINIATURE_VERSION, TARGET_CACHE
from common.miniatures.miniature_lm import LMSettings
from common.miniatures.targets import write_kimi_target
from common.target.config import load_target_info, weight_map
from common.target.int4_experts import PACKED_PARAMS, PackedLinear
from common.target.model import load_text_model

EXPERTS_DOMINATE = {"hidden_size": 128, "moe_intermediate_size": 512, "n_routed_experts": 256,
                    "num_experts_per_tok": 8}
GOAL = 1.15


def ensure_variant(int4: bool) -> Path:
    """The experts-dominate variant (INT4 or bf16 experts, same weights), written once and cached."""
    final = TARGET_CACHE / f"bench-experts-{'int4' if int4 else 'bf16'}-v{MINIATURE_VERSION}"
    if not (final / "config.json").exists():
        TARGET_CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".bench-", dir=TARGET_CACHE))
        # Few LM steps: this variant measures speed and memory, not what the model says.
        write_kimi_target(tmp, int4_experts=int4, text_overrides=EXPERTS_DOMINATE, num_shards=16,
                          lm_settings=LMSettings(steps=20))
        os.replace(tmp, final)
    return final


def _rss(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def disk_sizes(target: Path, prefix: str) -> dict[str, int]:
    """Bytes of each tensor under `prefix` as stored, read from the safetensors headers."""
    from safetensors import safe_open

    sizes, by_shard = {}, {}
    for name, shard in weight_map(target).items():
        if name.startswith(prefix):
            by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        with safe_open(str(target / shard), framework="pt") as f:
            for name in names:
                piece = f.get_slice(name)
                numel = 1
                for dim in piece.get_shape():
                    numel *= dim
                sizes[name] = numel * _DTYPE_BYTES[piece.get_dtype()]
    return sizes


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "I8": 1, "BOOL": 1}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(target: Path, samples: int, batch_tokens: int) -> dict:
    """One variant, in this (fresh) process: load, extract, and account for time and memory."""
    from datasets import Dataset

    from bench.bench_02_extract import demo_samples, run_ours

    info = load_target_info(target, trust_remote_code=True)
    sizes = disk_sizes(target, info.weight_prefix)  # from the shards' headers: nothing loaded yet
    disk_bytes = sum(sizes.values())
    packed_disk = sum(n for k, n in sizes.items() if k.endswith(PACKED_PARAMS))
    ids = demo_samples(target, samples)

    # Time spent dequantizing packed experts, measured by wrapping the method the forward calls.
    decompress = {"seconds": 0.0, "calls": 0}
    original = PackedLinear.dequantized_weight

    def timed(self, dtype):
        start = time.perf_counter()
        weight = original(self, dtype)
        decompress["seconds"] += time.perf_counter() - start
        decompress["calls"] += 1
        return weight

    PackedLinear.dequantized_weight = timed
    Dataset.from_dict({"input_ids": [[0]]})  # the data library's own memory, before the baseline
    _reset_peak()
    before = _rss("VmRSS")
    start = time.perf_counter()
    model = load_text_model(info, dtype=torch.bfloat16)
    load_s = time.perf_counter() - start
    load_peak = _rss("VmHWM") - before
    after_load = _rss("VmRSS")
    _reset_peak()
    with tempfile.TemporaryDirectory() as out:
        stats = run_ours(model, info.default_layer_ids(), ids, Path(out), batch_tokens)
    run_excess = _rss("VmHWM") - after_load
    packed_modules = [m for m in model.modules() if isinstance(m, PackedLinear)]
    return {
        "target": str(target), "tokens": sum(map(len, ids)), "load_s": load_s,
        "seconds": stats["seconds"], "forward_seconds": stats["forward_seconds"],
        "decompress_seconds": decompress["seconds"], "decompress_calls": decompress["calls"],
        "disk_bytes": disk_bytes, "packed_disk_bytes": packed_disk,
        "resident_weight_bytes": _tensor_bytes([*model.parameters(), *model.buffers()]),
        "resident_packed_bytes": _tensor_bytes(p for m in packed_modules for p in m.parameters()),
        "load_peak_bytes": load_peak, "loaded_bytes": after_load - before, "run_excess_bytes": run_excess,
    }


def run(samples: int = 40, batch_tokens: int = 1024, threads: int | None = None) -> dict:
    """Both variants, each in its own process; the side-by-side figures."""
    results = {}
    for name, int4 in (("int4", True), ("bf16", False)):
        target = ensure_variant(int4)
        cmd = [sys.executable, __file__, "--measure", str(target), "--samples", str(samples),
               "--batch-tokens", str(batch_tokens)] + (["--threads", str(threads)] if threads else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    q, b = results["int4"], results["bf16"]
    # Both runs hold the same activations (same samples, batches, bf16 compute); what the INT4 run
    # takes above the bf16 run during extraction is charged to its weights (per-call dequantization).
    # (The RSS peak can read a little under the tensor bytes when the loader reuses pages freed
    # before the baseline, so the larger of the two is taken.)
    loaded = max(q["load_peak_bytes"], q["resident_weight_bytes"])
    weight_peak = loaded + max(0, q["run_excess_bytes"] - b["run_excess_bytes"])
    return {
        **results, "samples": samples, "batch_tokens": batch_tokens, "threads": threads or torch.get_num_threads(),
        "int4_tokens_per_s": q["tokens"] / q["seconds"], "bf16_tokens_per_s": b["tokens"] / b["seconds"],
        "speed_ratio": (q["tokens"] / q["seconds"]) / (b["tokens"] / b["seconds"]),
        "int4_weight_peak_bytes": weight_peak,
        "int4_peak_over_disk": weight_peak / q["disk_bytes"],
        "decompress_share": q["decompress_seconds"] / q["forward_seconds"],
        "packed_kept": q["resident_packed_bytes"] == q["packed_disk_bytes"],
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch compute threads (default: torch's)")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)  # one variant, JSON out
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure(args.measure, args.samples, args.batch_tokens)))
        return 0
    r = run(args.samples, args.batch_tokens, args.threads)
    q, b = r["int4"], r["bf16"]
    print(f"{r['samples']} demo samples, {q['tokens']:,} tokens, batches of {r['batch_tokens']} tokens, bf16 compute "
          f"on the CPU, {r['threads']} threads; Kimi-style miniature with 256 experts of 128 x 512 (8 active)")
    rows = [
        ("", "INT4 experts (packed)", "bf16 experts", "ratio"),
        ("checkpoint (language model)", _mb(q["disk_bytes"]), _mb(b["disk_bytes"]),
         f"{q['disk_bytes'] / b['disk_bytes']:#.3g}"),
        ("02 tokens/s", f"{r['int4_tokens_per_s']:,.0f}", f"{r['bf16_tokens_per_s']:,.0f}", f"{r['speed_ratio']:#.3g}"),
        ("weights: peak while loading", _mb(q["load_peak_bytes"]), _mb(b["load_peak_bytes"]),
         f"{q['load_peak_bytes'] / b['load_peak_bytes']:#.3g}"),
        ("weight tensors after the run", _mb(q["resident_weight_bytes"]), _mb(b["resident_weight_bytes"]),
         f"{q['resident_weight_bytes'] / b['resident_weight_bytes']:#.3g}"),
        ("run: peak above loaded model", _mb(q["run_excess_bytes"]), _mb(b["run_excess_bytes"]),
         f"{q['run_excess_bytes'] / b['run_excess_bytes']:#.3g}"),
        ("dequantization share of forward", f"{r['decompress_share']:.1%}", "-", "-"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    ok = r["int4_peak_over_disk"] <= GOAL
    print(f"INT4 peak weight memory {_mb(r['int4_weight_peak_bytes'])} (loading peak, at least its tensors, "
          f"+ what its run took above the bf16 run) / packed checkpoint on disk: {r['int4_peak_over_disk']:#.3g} "
          f"(goal <= {GOAL}: "
          f"{'met' if ok else 'NOT met'}); packed expert bytes in memory after the run "
          f"{'equal' if r['packed_kept'] else 'DIFFER FROM'} those on disk ({_mb(q['packed_disk_bytes'])}); "
          f"{q['decompress_calls']:,} per-call dequantizations")
    return 0 if ok and r["packed_kept"] else 1


if __name__ == "__main__":
    sys.exit(main())
