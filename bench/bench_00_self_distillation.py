"""Benchmark of step 00: a draft trained on the target's own answers against one trained on the
original answers of the same conversations, same settings, measured by 05 at temperature 0 and 1.

    python bench/bench_00_self_distillation.py [--out bench/out/self_distillation] [--target DIR]
        [--max-samples N] [--max-new-tokens 256] [--temperature T] [--epochs N] [--draft-config FILE]
        [--max-prompts 20] [--max-new 64]

1. 00 regenerates the demo conversations with the target (greedy unless its generation config
   says otherwise) into OUT/regenerated/regenerated/.
2. The original records of exactly the conversations 00 kept, in the same order, go to
   OUT/original_inputs.jsonl, so both prepared datasets have the same rows and 04's seeded
   split holds out the same conversations in both runs (checked).
3. 01 -> 04 for each arm with the same flags (OUT/original/, OUT/regenerated/).
4. 05 on the regenerated run with `--reference OUT/original/draft`: both drafts decode the same
   held-out prompts (a conversation up to its first answer is the same text in both arms), at
   temperature 0 and at 1. The table gives the measured acceptance lengths and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common.prepare.readers import iter_records, resolve_inputs

ROOT = Path(__file__).resolve().parent.parent

DEMO = sorted((ROOT / "data").glob("demo_*.jsonl"))


def step(script: str, *args) -> None:
    cmd = [sys.executable, str(ROOT / script), *map(str, args)]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print("\n".join(proc.stdout.strip().splitlines()[-3:]), flush=True)


def original_of_kept(regenerated: Path, out: Path) -> int:
    """Write the original records of the conversations 00 kept, in its order; return the count."""
    kept = [json.loads(line)["id"] for p in sorted(regenerated.glob("*.jsonl")) for line in p.read_text().splitlines()]
    by_id = {}
    for sample_id, record in iter_records(resolve_inputs(DEMO)):
        by_id[str(record.get("id", sample_id))] = record
    out.write_text("".join(json.dumps(by_id[i], ensure_ascii=False) + "\n" for i in kept), encoding="utf-8")
    return len(kept)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "self_distillation")
    parser.add_argument("--target", type=Path, default=None, help="default: the built-in Kimi-style miniature")
    parser.add_argument("--max-samples", type=int, default=None, help="first N demo records (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="00, per turn")
    parser.add_argument("--temperature", type=float, default=None,
                        help="00's sampling (default: the target's generation_config.json: greedy for the miniature)")
    parser.add_argument("--draft-config", type=Path, default=None, help="04 (default: its own for the target)")
    parser.add_argument("--epochs", type=int, default=None, help="04 (default: the draft config's)")
    parser.add_argument("--max-prompts", type=int, default=20, help="05")
    parser.add_argument("--max-new", type=int, default=64, help="05's --max-new-tokens")
    args = parser.parse_args()
    out = args.out
    # the built-in target: no --target, so every stage takes its defaults for it (as the main job)
    common = [] if args.target is None else ["--target", args.target, "--trust-remote-code"]

    # 1. the target's own answers
    regen_run = out / "regenerated"
    limit = ["--max-samples", args.max_samples] if args.max_samples else []
    limit += ["--temperature", args.temperature] if args.temperature is not None else []
    step("00_regenerate.py", *common, "--run-dir", regen_run, "--max-new-tokens", args.max_new_tokens, *limit)
    # 2. the same conversations with their original answers
    n = original_of_kept(regen_run / "regenerated", out / "original_inputs.jsonl")
    print(f"{n} conversations kept by 00: both arms train on them")
    # 3. 01 -> 04, same flags
    inputs = {"original": out / "original_inputs.jsonl", "regenerated": regen_run / "regenerated"}
    for arm, data in inputs.items():
        run = ["--run-dir", out / arm, *common]
        step("01_prepare_data.py", *run, "--input", data)
        step("02_extract_hidden_states.py", *run)
        step("03_build_vocab_map.py", *run)
        train = [*(["--epochs", args.epochs] if args.epochs else []),
                 *(["--draft-config", args.draft_config] if args.draft_config else [])]
        step("04_train.py", *run, *train)
    splits = [json.loads((out / arm / "draft" / "validation_split.json").read_text())["validation_rows"]
              for arm in inputs]
    if splits[0] != splits[1]:
        sys.exit("the two runs held out different rows; the comparison would not be on the same prompts")
    # 4. both drafts on the same prompts, T = 0 and T = 1
    figures = {}
    for temperature in (0, 1):
        report = out / f"eval_t{temperature}.json"
        step("05_evaluate.py", "--run-dir", regen_run, *common, "--reference", out / "original" / "draft",
             "--temperature", temperature, "--max-prompts", args.max_prompts, "--max-new-tokens", args.max_new,
             "--json", report)
        data = json.loads(report.read_text())
        figures[temperature] = {d["name"]: d for d in data["drafts"]} | {
            name: b for name, b in data["baselines"].items()}
    print(f"\nmeasured acceptance length (05, k = 3, {args.max_prompts} held-out prompts, same for both drafts)")
    print(f"{'temperature':>11}  {'original answers':>16}  {'regenerated':>11}  {'ratio':>6}  {'n-gram':>6}")
    for temperature, rows in figures.items():
        ours, ref = (rows[name]["measured_acceptance_length"] for name in ("draft", "reference"))
        ngram = rows.get("ngram", {}).get("measured_acceptance_length")
        print(f"{temperature:>11}  {ref:>16.3f}  {ours:>11.3f}  {ours / ref:>6.3g}  "
              f"{ngram if ngram is None else format(ngram, '.3f'):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
