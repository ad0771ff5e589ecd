"""Benchmark of 04 --online against the offline pipeline (02's files, then 04), side by side in one
run on the same prepared rows, vocabulary, settings and seeds.

    python bench/bench_04_online.py [--target flat|kimi] [--samples 200] [--seeds 0 1 2]
        [--engine hf|vllm] [--epochs 2] [--json FILE]

Measures:
- disk: bytes 02 writes for 04 offline vs bytes 04 --online writes outside its checkpoints and draft
  (goal: at most 1%); with --max-disk at a third of 02's bytes, the kept folder against the budget;
- same draft: 02 and 04 --online with one sample per forward pass (--batch-tokens 1: the same
  arithmetic), the exported drafts compared byte for byte; at the default batching, the drafts'
  acceptance length by 05 on the held-out rows (measured by decoding, and simulated on 02's files),
  online vs offline per seed (goal: within 0.03, the mean within the seed-to-seed spread);
- time: 02 + an offline run against the online run (wall clock of the commands, and the training
  epochs alone from train_report.json), and the share of the online epochs spent waiting for states.

Every stage runs as its real script in a subprocess on one thread. A GPU host changes the time
figures (see the README): there the target's forward pass costs far more than the draft's step,
so the wait share is the figure to watch and --prefetch / a separate vLLM host the remedies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common.defaults import REPO_ROOT
from common.draft.model import TINY_CONFIG
from common.miniatures.targets import DEMO_CONVERSATIONS, ensure_target

DEFAULT_OUT = REPO_ROOT / "bench" / "out" / "online04"
ENV = {"OMP_NUM_THREADS": "1"}


def script(name: str, *args: str | Path) -> float:
    """Run a numbered script; its wall-clock seconds."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO_ROOT / name), *map(str, args)], cwd=REPO_ROOT, text=True,
                          capture_output=True, env={**os.environ, **ENV})
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def folder_bytes(folder: Path, skip: tuple[str, ...] = ()) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and not any(part in skip for part in p.relative_to(folder).parts))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def epoch_seconds(run: Path) -> float:
    report = json.loads((run / "train_report.json").read_text())
    return report["tokens_per_epoch"] / report["tokens_per_second"]


def run(target_kind: str = "flat", samples: int = 200, seeds: tuple[int, ...] = (0, 1, 2), engine: str = "hf",
        epochs: int = 2, out: Path = DEFAULT_OUT) -> dict:
    target = ensure_target(target_kind)
    base = out / target_kind
    common = ["--target", target, "--trust-remote-code"]
    if not (base / "vocab").is_dir():
        script("01_prepare_data.py", *common, "--run-dir", base, "--input", DEMO_CONVERSATIONS,
               "--max-samples", samples, "--max-len", 1024)
        script("03_build_vocab_map.py", *common, "--run-dir", base, "--draft-vocab-size", 1024)
    train = [*common, "--draft-config", TINY_CONFIG, "--vocab", base / "vocab", "--epochs", epochs,
             "--total-seq-len", 1024]
    online = ["--online", "--engine", engine, "--prepared", base / "prepared"]

    # 1. the same arithmetic: one sample per forward pass in 02 and online; the drafts byte for byte
    exact = base / "exact"
    engine_flags = ["--engine", engine]  # 02 offline through the same engine as online
    script("02_extract_hidden_states.py", *common, *engine_flags, "--run-dir", exact, "--prepared", base / "prepared",
           "--batch-tokens", 1)
    script("04_train.py", *train, "--run-dir", exact, "--output", exact / "offline")
    script("04_train.py", *train, *online, "--batch-tokens", 1, "--run-dir", exact / "online")
    same_draft = sha256(exact / "offline/draft/model.safetensors") == sha256(exact / "online/draft/model.safetensors")

    # 2. the default batching, per seed: time, disk, and the drafts by 05
    offline_run = base / "offline"
    seconds_02 = script("02_extract_hidden_states.py", *common, *engine_flags, "--run-dir", offline_run, "--prepared",
                        base / "prepared")
    bytes_02 = folder_bytes(offline_run / "hidden_states")
    rows = []
    for seed in seeds:
        off, onl = offline_run / f"seed{seed}", base / f"online{seed}"
        seconds_off = script("04_train.py", *train, "--seed", seed, "--run-dir", offline_run, "--output", off)
        seconds_on = script("04_train.py", *train, *online, "--seed", seed, "--run-dir", onl)
        report = json.loads((onl / "train_report.json").read_text())
        waited = sum(report["state_wait_seconds"].values())
        evaluation = base / f"eval{seed}.json"
        script("05_evaluate.py", *common, "--run-dir", offline_run, "--prepared", base / "prepared", "--draft",
               off / "draft", "--reference", onl / "draft", "--max-prompts", 8, "--max-new-tokens", 32,
               "--no-baselines", "--json", evaluation)
        drafts = {d["name"]: d for d in json.loads(evaluation.read_text())["drafts"]}
        rows.append({
            "seed": seed, "seconds_02": seconds_02, "seconds_04_offline": seconds_off, "seconds_04_online": seconds_on,
            "epoch_seconds_offline": epoch_seconds(off), "epoch_seconds_online": epoch_seconds(onl),
            "wait_share": waited / (epochs * epoch_seconds(onl)),
            "online_bytes_written": folder_bytes(onl, skip=("checkpoints", "draft")),
            "measured_al_offline": drafts["draft"]["measured_acceptance_length"],
            "measured_al_online": drafts["reference"]["measured_acceptance_length"],
            "simulated_al_offline": drafts["draft"]["simulated_acceptance_length"],
            "simulated_al_online": drafts["reference"]["simulated_acceptance_length"]})

    # 3. a disk budget of a third of 02's bytes
    budget = bytes_02 // 3
    kept_run = base / "kept"
    script("04_train.py", *train, *online, "--run-dir", kept_run, "--max-disk", budget)
    kept = folder_bytes(kept_run / "hidden_states", skip=()) if (kept_run / "hidden_states").is_dir() else 0

    def spread(key: str) -> float:
        return max(r[key] for r in rows) - min(r[key] for r in rows)

    diffs = [r["measured_al_online"] - r["measured_al_offline"] for r in rows]
    result = {
        "target": target_kind, "engine": engine, "samples": samples, "epochs": epochs, "seeds": list(seeds),
        "same_draft_at_the_same_arithmetic": same_draft,
        "bytes_02": bytes_02, "online_bytes_written": statistics.median(r["online_bytes_written"] for r in rows),
        "online_disk_share": statistics.median(r["online_bytes_written"] for r in rows) / bytes_02,
        "max_disk_budget": budget, "max_disk_kept": kept, "max_disk_share_of_budget": kept / budget,
        "measured_al_difference_per_seed": diffs,
        "measured_al_offline_mean": statistics.mean(r["measured_al_offline"] for r in rows),
        "measured_al_online_mean": statistics.mean(r["measured_al_online"] for r in rows),
        "measured_al_seed_spread_offline": spread("measured_al_offline"),
        "simulated_al_difference_per_seed": [r["simulated_al_online"] - r["simulated_al_offline"] for r in rows],
        "time_ratio_online_vs_02_plus_offline": statistics.median(
            r["seconds_04_online"] / (r["seconds_02"] + r["seconds_04_offline"]) for r in rows),
        "epoch_ratio_online_vs_offline": statistics.median(
            r["epoch_seconds_online"] / r["epoch_seconds_offline"] for r in rows),
        "wait_share_median": statistics.median(r["wait_share"] for r in rows),
        "runs": rows}
    return result


def print_table(r: dict) -> None:
    print(f"04 --online vs 02 + 04 ({r['target']} miniature, engine {r['engine']}, {r['samples']} samples, "
          f"{r['epochs']} epochs, seeds {r['seeds']})")
    print(f"  same arithmetic (--batch-tokens 1): drafts byte for byte equal: {r['same_draft_at_the_same_arithmetic']}")
    print(f"  disk: 02 wrote {r['bytes_02']:,} B; online wrote {r['online_bytes_written']:,.0f} B outside checkpoints "
          f"({r['online_disk_share']:.2%}, goal <= 1%)")
    print(f"  --max-disk {r['max_disk_budget']:,} B: kept {r['max_disk_kept']:,} B "
          f"({r['max_disk_share_of_budget']:.1%} of the budget)")
    per_seed = ", ".join(f"{d:+.3f}" for d in r["measured_al_difference_per_seed"])
    print(f"  05 measured acceptance length online - offline per seed: {per_seed} (goal: within 0.03); means "
          f"{r['measured_al_online_mean']:.3f} vs {r['measured_al_offline_mean']:.3f}, offline seed spread "
          f"{r['measured_al_seed_spread_offline']:.3f}")
    print("  05 simulated (02's files) online - offline per seed: "
          + ", ".join(f"{d:+.3f}" for d in r["simulated_al_difference_per_seed"]))
    print(f"  time: online run / (02 + offline run) {r['time_ratio_online_vs_02_plus_offline']:.2f} (commands' wall "
          f"clock); online epoch / offline epoch {r['epoch_ratio_online_vs_offline']:.2f}; waiting for states "
          f"{r['wait_share_median']:.0%} of the online epochs (medians over seeds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["flat", "kimi"], default="flat")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.target, args.samples, tuple(args.seeds), args.engine, args.epochs, args.out)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
