"""Step 03: choose the draft vocabulary from the supervised tokens of the prepared dataset.

Counts how often each token id appears under loss_mask 1, keeps the `--draft-vocab-size` most
frequent ids (speculators' rule: ties by the lower id, a shortfall filled with the lowest unused
ids) and writes the maps the draft model is built with.

Usage:
    python 03_build_vocab_map.py                                  # runs/default/prepared -> runs/default/vocab
    python 03_build_vocab_map.py --prepared RUN/prepared --target DIR --output RUN/vocab \
        [--draft-vocab-size 32000] [--trust-remote-code]

Writes into the output folder: t2d.pt (bool[target_vocab]), d2t.pt (int64[draft_vocab] offsets,
target id = i + d2t[i]), token_freq.pt (dense int64[target_vocab] counts) and vocab_report.json
(coverage = share of supervised tokens inside the draft vocabulary). A draft vocabulary as large
as the target's gives the identity map.
"""

from __future__ import annotations

import argparse
import time

from common.cli import add_data_args, resolve_target, run_main, stage_dir, stage_parser
from common.defaults import MINIATURE_DRAFT_VOCAB_SIZE
from common.errors import PipelineError
from common.prepare.fingerprints import prepared_fingerprint
from common.prepare.prepared_dataset import check_prepared_target, load_prepared
from common.target.config import load_target_info
from common.vocab import (
    DEFAULT_BATCH_ROWS,
    DEFAULT_DRAFT_VOCAB_SIZE,
    build_maps,
    check_draft_vocab_size,
    count_supervised_tokens,
    make_report,
    write_vocab,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = stage_parser(__doc__)
    add_data_args(parser, "vocab", prepared="prepared dataset folder from 01_prepare_data.py")
    vocab = parser.add_argument_group("vocabulary")
    vocab.add_argument("--draft-vocab-size", type=int, default=None,
                       help=f"draft vocabulary size (default: {DEFAULT_DRAFT_VOCAB_SIZE}, or the target's "
                            f"vocabulary if smaller; {MINIATURE_DRAFT_VOCAB_SIZE} for the built-in miniature target)")
    vocab.add_argument("--batch-rows", type=int, default=DEFAULT_BATCH_ROWS,
                       help="samples read per Arrow batch while counting (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.batch_rows <= 0:
        raise PipelineError(f"--batch-rows {args.batch_rows}: must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prepared_dir = stage_dir(args, "prepared", args.prepared)
    out_dir = stage_dir(args, "vocab", args.output)

    # 1. The prepared dataset (first: a missing folder is the most common mistake).
    ds, prepared = load_prepared(prepared_dir)

    # 2. The target's vocabulary: refuse data tokenized for another target, and a draft larger than it.
    target, trust_remote_code = resolve_target(args)
    info = load_target_info(target, trust_remote_code)
    check_prepared_target(prepared, prepared_dir, info.path, info.vocab_size)
    draft_size = args.draft_vocab_size
    if draft_size is None:
        builtin = args.target is None
        draft_size = MINIATURE_DRAFT_VOCAB_SIZE if builtin else min(DEFAULT_DRAFT_VOCAB_SIZE, info.vocab_size)
    check_draft_vocab_size(draft_size, info.vocab_size)
    print(f"counting supervised tokens of {len(ds):,} samples in {prepared_dir} "
          f"(target vocabulary {info.vocab_size:,})")

    # 3. Count supervised tokens, then pick the draft vocabulary.
    start = time.perf_counter()
    counts = count_supervised_tokens(ds, info.vocab_size, batch_rows=args.batch_rows)
    seconds = time.perf_counter() - start
    d2t, t2d = build_maps(counts, draft_size)
    report = make_report(counts, t2d, target=info.path, prepared=prepared_dir.resolve(), samples=len(ds))
    report.prepared_fingerprint = prepared_fingerprint(prepared_dir)

    # 4. Write the maps, the counts and the report atomically.
    write_vocab(out_dir, d2t, t2d, counts, report)

    print(f"counted {report.supervised_tokens:,} supervised tokens in {report.samples:,} samples "
          f"({report.distinct_tokens:,} distinct ids) in {seconds:.2f} s")
    kind = "identity map" if report.identity else f"{report.draft_vocab_size:,} of {report.target_vocab_size:,} ids"
    print(f"draft vocabulary: {kind}, coverage {report.coverage:.2%} of supervised tokens")
    print(f"wrote t2d.pt, d2t.pt, token_freq.pt, vocab_report.json to {out_dir}")
    return 0


if __name__ == "__main__":
    run_main(main)
