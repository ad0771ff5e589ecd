"""Every stage's benchmark in one run, and one table of ratios (ours vs the reference way).

    python bench/run_all.py              # after the main job (01 -> 05) has filled runs/default
    python bench/run_all.py --quick      # fewer samples and repeats, for a first look

Each row is measured side by side in one process (medians of repeats), so the ratio holds on a
shared, noisy machine where absolute figures do not. Goals: 02 >= 3x tokens/s at
exactly 4 x hidden x 2 bytes per token, 03 >= 10x, 04 >= 1.0x upstream speculators' trainer (when
.venv-speculators/ exists) and >= 0.9x the bare step, 05 lossless (its speed ratio is
below 1 on the CPU miniature, see bench/bench_05_speculative.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import bench_02_extract, bench_02_resume, bench_03_vocab, bench_04_train, bench_05_speculative
from common.defaults import DEFAULT_RUN_DIR


def rows(quick: bool, run_dir: Path) -> list[tuple[str, str, str, str, str]]:
    """(stage, ours, reference, ratio, goal) per benchmark."""
    repeats = 1 if quick else 3
    r2 = bench_02_extract.run(samples=60 if quick else 200, repeats=repeats)
    r2r = bench_02_resume.run(samples=10_000 if quick else 100_000, repeats=repeats)
    r3 = bench_03_vocab.run(samples=2000 if quick else 20000, repeats=repeats)
    r4 = bench_04_train.run("flat", bench_04_train.REPO_ROOT / "bench" / "out" / "train04-flat", repeats, True)
    m4 = r4["median_tokens_per_s"]
    r5 = bench_05_speculative.run(run_dir=run_dir, prompts=4 if quick else 8, repeats=repeats)
    return [
        ("02 extract: tokens/s", f"{r2['ours_tokens_per_s']:,.0f}", f"{r2['naive_tokens_per_s']:,.0f} (naive)",
         f"{r2['speedup']:#.3g}x", goal(r2["speedup"], 3.0, ">= 3x")),
        ("02 extract: tokens/s", f"{r2['ours_tokens_per_s']:,.0f}",
         f"{r2['realistic_tokens_per_s']:,.0f} (realistic: batched bf16, 4 states)",
         f"{r2['speedup_over_realistic']:#.3g}x", "-"),
        ("02 extract: bytes/token", f"{r2['ours_state_bytes_per_token']:,.0f}",
         f"{r2['naive_state_bytes_per_token']:,.0f} (naive)",
         f"{r2['naive_state_bytes_per_token'] / r2['ours_state_bytes_per_token']:#.3g}x less",
         f"= {r2['expected_state_bytes_per_token']} (4 x hidden x 2)"),
        ("02 extract: forward share", f"{r2['forward_share']:.0%}", "-", "-", "limit 100%"),
        (f"02 restart scan: seconds ({r2r['samples'] // 1000}K files)", f"{r2r['ours_seconds']:.2f} (journal)",
         f"{r2r['reference_seconds']:.2f} (load each)", f"{r2r['ratio']:#.3g}x", f">= {bench_02_resume.GOAL:g}x"),
        ("03 vocab counting: seconds", f"{r3['ours_s']:.2f}", f"{r3['speculators_s']:.2f} (speculators)",
         f"{r3['speedup']:#.3g}x", goal(r3["speedup"], 10.0, ">= 10x")),
        *([("04 training: tokens/s", f"{m4['04']:,.0f}", f"{m4['upstream']:,.0f} (speculators 0.9.0's trainer)",
             f"{r4['ratio_vs_upstream']:#.3g}x", goal(r4["ratio_vs_upstream"], 1.0, ">= 1.0x"))]
          if r4["ratio_vs_upstream"] is not None else []),
        ("04 training: tokens/s", f"{m4['04']:,.0f}", f"{m4['bare_step']:,.0f} (bare step, batches in memory)",
         f"{r4['ratio_vs_bare_step']:#.3g}x", goal(r4["ratio_vs_bare_step"], 0.9, ">= 0.9x")),
        (f"05 decoding: tokens/s ({100 * r5['degenerate_share']:#.3g}% of greedy generations loop)",
         f"{r5['speculative_tokens_per_s']:,.0f} (speculative)",
         f"{r5['greedy_tokens_per_s']:,.0f} (greedy)",
         f"{r5['ratio']:#.3g} (acceptance {r5['acceptance_length']:#.3g})",
         "lossless: " + ("yes" if r5["identical_to_greedy"] else "NO")),
    ]


def goal(value: float, threshold: float, text: str) -> str:
    """The goal and whether the unrounded value meets it."""
    return f"{text}: {'met' if value >= threshold else 'NOT met'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and one repeat")
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="the main job's run folder (for 05)")
    args = parser.parse_args()
    table = [("benchmark", "ours", "reference", "ratio", "goal"), *rows(args.quick, args.run_dir)]
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    print()
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
