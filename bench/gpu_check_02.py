"""GPU check of step 02: the correctness tests of tests/test_02_extract.py, on CUDA.

For both miniature targets: 01 prepares demo conversations, 02 extracts them on the GPU in bf16
(its GPU default) twice, batched and one sample per forward, and the stored states are checked
against a plain bf16 forward of the target (lm_head(final state) gives the target's logits, aux
state i is hidden_states[i]); the capture itself is checked in fp32 on the GPU (batched equals
sample by sample, same argmax everywhere).
Ends with the speed benchmark on the GPU. Exit status 0 when every check passes.

Usage (on a GPU host, from the repository root):
    python bench/gpu_check_02.py [--samples 64] [--work DIR] [--skip-bench]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_02_extract import run as run_bench
from common.defaults import REPO_ROOT
from common.extract.hf_engine import StateExtractor
from common.extract.verify import verify_samples
from common.hidden_states.state_files import list_sample_files
from common.hidden_states.storage import FP32_CHECK
from common.miniatures.targets import ensure_target
from common.target.config import load_target_info
from common.target.model import load_text_model

DEVICE = "cuda:0"


def script(name: str, *args: str | Path) -> str:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO_ROOT / name), *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return f"{name} ({time.perf_counter() - start:.0f}s): " + " | ".join(lines[-4:])


def check(name: str, ok: bool, detail: str, failures: list[str]) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    if not ok:
        failures.append(name)


def verify_folder(model: torch.nn.Module, out: Path, layer_ids: list[int]):
    pairs = []
    for path in list_sample_files(out).values():
        data = torch.load(path, weights_only=True)
        pairs.append((data["input_ids"].tolist(), data["hidden_states"]))
    return verify_samples(model, pairs, layer_ids), pairs


def describe(v) -> str:
    return (f"{v.tokens:,} tokens, argmax agreement {v.argmax_agreement:.4f}, unexplained mismatches "
            f"{v.unexplained_mismatches}, max logit diff {v.max_logit_diff:.4f}, max aux error {v.max_aux_error:.2e}")


def check_target(kind: str, work: Path, samples: int, failures: list[str]) -> None:
    target = ensure_target(kind, cache_dir=work / "targets")
    info = load_target_info(target, trust_remote_code=True)
    layer_ids = info.default_layer_ids()
    prepared = work / kind / "prepared"
    print(f"{kind}: {target}")
    print("  " + script("01_prepare_data.py", "--target", target, "--trust-remote-code", "--output", prepared,
                        "--max-samples", samples))
    common = ["--prepared", prepared, "--target", target, "--trust-remote-code", "--device", DEVICE, "--dtype", "bf16"]
    batched, alone = work / kind / "batched", work / kind / "alone"
    print("  " + script("02_extract_hidden_states.py", *common, "--output", batched))
    print("  " + script("02_extract_hidden_states.py", *common, "--output", alone, "--batch-tokens", "1"))

    # bf16, one sample per forward: the stored states are exactly those of a plain bf16 forward.
    model = load_text_model(info, dtype=torch.bfloat16, device=DEVICE)
    v, _ = verify_folder(model, alone, layer_ids)
    check("bf16 files (one sample per forward) vs target", v.argmax_agreement == 1.0 and v.max_logit_diff < 1e-2
          and v.max_aux_error < 1e-2, describe(v), failures)
    # bf16 batched (the default run): bf16 rounding differs between batch shapes (and can flip a
    # MoE routing choice at a near-tie), so only a near-tie may change the argmax.
    v, _ = verify_folder(model, batched, layer_ids)
    check("bf16 files (batched) vs target", v.argmax_agreement > 0.95, describe(v), failures)
    del model

    # The capture in fp32 on the GPU (TF32 off): batched == sample by sample, the target's own logits.
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_text_model(info, dtype=torch.float32, device=DEVICE)
    ids = [torch.load(p, weights_only=True)["input_ids"].tolist() for p in list(list_sample_files(alone).values())[:8]]
    extractor = StateExtractor(model, layer_ids, storage=FP32_CHECK)
    states = [stored.states for stored in extractor(ids)]
    worst = max(float((a - b).abs().max() / b.abs().max()) for sample, per_sample in zip(ids, states)
                for a, b in zip(per_sample, extractor([sample])[0].states))
    check("fp32 batched vs one by one", worst < 1e-4, f"max relative difference {worst:.2e}", failures)
    v = verify_samples(model, list(zip(ids, states)), layer_ids)
    check("fp32 capture vs target", v.argmax_agreement == 1.0 and v.max_logit_diff < 1e-3 and v.max_aux_error < 1e-5,
          describe(v), failures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for kind in ("kimi", "flat"):
            check_target(kind, work, args.samples, failures)
    if not args.skip_bench:
        r = run_bench(samples=200, repeats=3, batch_tokens=16384, device=DEVICE)
        print(f"bench on {DEVICE}: {r['tokens']:,} tokens, ours {r['ours_tokens_per_s']:,.0f} tok/s, naive "
              f"{r['naive_tokens_per_s']:,.0f} tok/s, ratio {r['speedup']:.1f}x; bytes/token ours "
              f"{r['ours_state_bytes_per_token']:.0f} (states), files ratio {r['bytes_ratio']:.1f}x; "
              f"forward {r['forward_share']:.0%}")
    print("PASS" if not failures else f"FAIL: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
