"""Benchmark of step 04's data path: training tokens per second of speculators' Trainer fed by
our data path (Eagle3SampleFileDataset over step 02's files, noise, packing sampler, collate,
DataLoader) against the same Trainer fed with the very same batches already in memory.

    python bench/bench_04_train.py [--run-dir bench/out/run04] [--samples 200] [--repeats 3]
        [--total-seq-len 1024] [--num-workers 0] [--draft-config configs/draft_tiny.json]

Uses RUN_DIR/hidden_states and RUN_DIR/vocab; when they are missing it first runs 01 -> 02 -> 03
on the demo conversations and the Kimi-style miniature target (`--samples` of them). Each
repeat trains one epoch each way, alternating, from the same initial draft; medians of the
repeats are printed with their ratio (goal: >= 0.9, the data path costing at most 10%).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from common.defaults import REPO_ROOT  # noqa: E402
from common.draft import patch  # noqa: E402
from common.draft.model import TINY_CONFIG, build_draft, read_config_file, speculator_config  # noqa: E402
from common.fixtures.targets import ensure_target  # noqa: E402
from common.hidden_states.loader import epoch_tokens, load_hidden_states, make_loader, split_data  # noqa: E402
from common.target.config import load_target_info  # noqa: E402
from common.train.settings import TrainSettings  # noqa: E402
from common.train.trainer import trainer_config  # noqa: E402
from common.vocab import load_vocab  # noqa: E402

DEFAULT_RUN = REPO_ROOT / "bench" / "out" / "run04"


def prepare_run(run_dir: Path, samples: int) -> None:
    """01 -> 02 -> 03 into `run_dir` (default target), as real subprocesses."""
    steps = (("01_prepare_data.py", ["--max-samples", str(samples)]), ("02_extract_hidden_states.py", []),
             ("03_build_vocab_map.py", ["--draft-vocab-size", "1024"]))
    for script, extra in steps:
        subprocess.run([sys.executable, str(REPO_ROOT / script), "--run-dir", str(run_dir), *extra], check=True,
                       cwd=REPO_ROOT, stdout=subprocess.DEVNULL)


class InMemoryBatches(list):
    """Collated batches in a list; `batch_sampler` is what the Trainer looks up on its loader."""

    batch_sampler = None


def time_epoch(make_model, settings: TrainSettings, loader, save_path: Path) -> float:
    """Seconds of one `Trainer.train_epoch` over `loader`, from a fresh draft and optimizer."""
    from speculators.train.trainer import Trainer

    model = make_model()
    trainer = Trainer(model, trainer_config(settings, save_path, False, False, torch.device("cpu")), loader, None)
    start = time.perf_counter()
    trainer.train_epoch(0)
    return time.perf_counter() - start


def run(run_dir: Path = DEFAULT_RUN, samples: int = 200, repeats: int = 3, total_seq_len: int = 1024,
        num_workers: int = 0, draft_config: Path = TINY_CONFIG) -> dict:
    """Median tokens/s of both feeds and their ratio (data path / in memory)."""
    if not (run_dir / "hidden_states" / "data_config.json").is_file() or not (run_dir / "vocab").is_dir():
        prepare_run(run_dir, samples)
    patch.apply(trust_remote_code=True, compile_forward=False)
    config_file = read_config_file(draft_config)
    settings, _ = TrainSettings.resolve(config_file, {"total_seq_len": total_seq_len, "num_workers": num_workers})
    info = load_target_info(ensure_target("kimi"), trust_remote_code=True)
    vocab = load_vocab(run_dir / "vocab", info.vocab_size)
    data = load_hidden_states(run_dir / "hidden_states")
    train_files, _val = split_data(data, settings)
    config = speculator_config(config_file.model, info, vocab.d2t.numel(), data.config.layer_ids, settings.ttt_steps)

    def make_model() -> torch.nn.Module:
        torch.manual_seed(settings.seed)
        return build_draft(config, vocab.t2d, vocab.d2t)

    loader = make_loader(data, train_files, settings, 1, 0, train=True, pin_memory=False)
    in_memory = InMemoryBatches(loader)  # the same epoch-0 batches (noise included), collated once
    tokens = epoch_tokens(data, train_files, settings.total_seq_len)
    seconds: dict[str, list[float]] = {"data_path": [], "in_memory": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            seconds["data_path"].append(time_epoch(make_model, settings, loader, Path(tmp)))
            seconds["in_memory"].append(time_epoch(make_model, settings, in_memory, Path(tmp)))
            print(f"repeat {r + 1}/{repeats}: data path {seconds['data_path'][-1]:.2f}s, "
                  f"in memory {seconds['in_memory'][-1]:.2f}s")
    rates = {k: tokens / statistics.median(v) for k, v in seconds.items()}
    return {"tokens_per_epoch": tokens, "steps_per_epoch": len(in_memory), "repeats": repeats,
            "data_path_tokens_per_s": rates["data_path"], "in_memory_tokens_per_s": rates["in_memory"],
            "ratio": rates["data_path"] / rates["in_memory"], "num_workers": num_workers,
            "total_seq_len": total_seq_len, "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN)
    parser.add_argument("--samples", type=int, default=200, help="samples prepared when the run folder is empty")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--total-seq-len", type=int, default=1024)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--draft-config", type=Path, default=TINY_CONFIG)
    args = parser.parse_args()
    result = run(args.run_dir, args.samples, args.repeats, args.total_seq_len, args.num_workers, args.draft_config)
    print(f"{result['tokens_per_epoch']:,} tokens per epoch in {result['steps_per_epoch']} steps, "
          f"medians of {result['repeats']} repeats, {result['torch_threads']} torch thread(s)")
    print(f"data path: {result['data_path_tokens_per_s']:,.0f} tok/s, in memory: "
          f"{result['in_memory_tokens_per_s']:,.0f} tok/s, ratio {result['ratio']:#.3g} "
          f"(goal >= 0.9: {'met' if result['ratio'] >= 0.9 else 'NOT met'}, checked unrounded)")


if __name__ == "__main__":
    main()
