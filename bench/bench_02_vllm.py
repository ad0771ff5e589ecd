"""Benchmark of 02's two engines, side by side on the same samples: transformers (hooks on the
base model, `--engine hf`) against vLLM (`--engine vllm`: the extract_hidden_states method and
its connector, in .venv-vllm), both writing the same bf16 v1 files through `ExtractionRun`.

The target is the flat miniature (vLLM's CPU kernels need its head size 32); both engines
compute in bf16. The vLLM engine is started once; its start-up time is printed apart, not
counted in tokens/s. Each repeat runs both engines; medians are compared.

Usage:
    python bench/bench_02_vllm.py [--samples 200] [--repeats 3] [--batch-tokens 2048]
    python bench/bench_02_vllm.py --target /models/SOME-LLAMA --device cuda:0   # on a GPU host

Goal: none on this CPU (a miniature this small measures each engine's overhead per sample,
not the GPU kernels); on a GPU host vLLM >= 1x the HF engine is expected.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset

from bench.bench_02_extract import demo_samples
from common.extract.batches import plan_batches
from common.extract.hf_engine import StateExtractor
from common.extract.run import ExtractionRun
from common.extract.vllm_engine import VllmStateExtractor, final_norm_of, worker_fetch
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES
from common.miniatures.targets import ensure_target
from common.target.config import load_target_info
from common.target.model import load_text_model
from common.vllm.client import EngineSettings, VllmWorker, check_vllm_python


def extract(extractor, samples: list[list[int]], batch_tokens: int) -> float:
    """Seconds for one extraction of `samples` into a temporary folder."""
    ds = Dataset.from_dict({"sample_id": [str(i) for i in range(len(samples))], "input_ids": samples,
                            "loss_mask": [[1] * len(s) for s in samples]})
    lengths = {i: len(s) for i, s in enumerate(samples)}
    with tempfile.TemporaryDirectory() as out:
        stats = ExtractionRun(extractor, ds, Path(out), show_progress=False).run(
            plan_batches(lengths, batch_tokens), set(), lengths)
    return stats.seconds


def run(samples: int = 200, repeats: int = 3, batch_tokens: int = 2048, target: Path | None = None,
        device: str = "cpu", vllm_python: Path | None = None) -> dict:
    target = target or ensure_target("flat")
    info = load_target_info(target, trust_remote_code=True)
    python = check_vllm_python(vllm_python)
    layer_ids = info.default_layer_ids()
    ids = demo_samples(target, samples)
    tokens = sum(map(len, ids))
    hf = StateExtractor(load_text_model(info, dtype=torch.bfloat16, device=device), layer_ids)
    with tempfile.TemporaryDirectory() as storage:
        settings = EngineSettings.for_target(info, max(map(len, ids)) + 1, trust_remote_code=False)
        settings.extract_layer_ids, settings.storage = [*layer_ids, info.num_layers], storage
        with VllmWorker(python, settings) as worker:
            served = VllmStateExtractor(worker_fetch(worker), layer_ids, final_norm_of(info), STORAGES[DEFAULT_STORAGE])
            times = [(extract(hf, ids, batch_tokens), extract(served, ids, batch_tokens)) for _ in range(repeats)]
            start = worker.start_seconds
    hf_s, vllm_s = (statistics.median(t[j] for t in times) for j in (0, 1))
    return {"target": str(target), "samples": samples, "tokens": tokens, "repeats": repeats,
            "batch_tokens": batch_tokens, "hf_tokens_per_s": tokens / hf_s, "vllm_tokens_per_s": tokens / vllm_s,
            "ratio": hf_s / vllm_s, "vllm_start_seconds": start, "threads": torch.get_num_threads()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--target", type=Path, default=None, help="default: the flat miniature")
    parser.add_argument("--device", default="cpu", help="the HF engine's device (default: %(default)s)")
    parser.add_argument("--vllm-python", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    r = run(args.samples, args.repeats, args.batch_tokens, args.target, args.device, args.vllm_python)
    print(f"{r['samples']} demo samples, {r['tokens']:,} tokens, {r['target']}, bf16, batches of "
          f"{r['batch_tokens']} tokens, median of {r['repeats']}; vLLM engine start {r['vllm_start_seconds']:.0f}s "
          "(not counted)")
    print(f"{'02 extract':<22}{'hf':>12}{'vllm':>12}{'vllm / hf':>12}")
    print(f"{'tokens/s':<22}{r['hf_tokens_per_s']:>12,.0f}{r['vllm_tokens_per_s']:>12,.0f}{r['ratio']:>12.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
