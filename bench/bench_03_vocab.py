"""Benchmark of step 03's counting: ours (Arrow batches + numpy bincount) against speculators'
`save_token_frequency_distribution` (one torch-formatted row at a time), on the same prepared set.

    python bench/bench_03_vocab.py [--samples 20000] [--repeats 3]

Builds a synthetic prepared dataset in a temporary folder (Kimi's 163840-token vocabulary,
200-1500 tokens per sample, Zipf-distributed ids, the later ~half of each sample supervised),
times both counters side by side, checks they agree, and prints medians and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from bench.timing import median_seconds
from common.miniatures.targets import KIMI_VOCAB_SIZE
from common.prepare.prepared_dataset import PrepareReport, load_prepared
from common.vocab import count_supervised_tokens

DEFAULT_SAMPLES = 20_000
MIN_LEN, MAX_LEN = 200, 1500


def write_synthetic_prepared(folder: Path, samples: int, vocab_size: int = KIMI_VOCAB_SIZE, seed: int = 0) -> int:
    """Write a prepared folder of `samples` synthetic rows; return its token count."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    lengths = rng.integers(MIN_LEN, MAX_LEN + 1, samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    # Zipf ranks mapped through a fixed permutation, so frequent ids are spread over the vocabulary.
    ranks = (rng.zipf(1.2, total) - 1) % vocab_size
    ids = rng.permutation(vocab_size)[ranks].astype(np.int32)
    # Each sample: a prompt of 30-70 % of its length (mask 0), then the supervised answer (mask 1).
    prompt_end = offsets[:-1] + (lengths * rng.uniform(0.3, 0.7, samples)).astype(np.int64)
    position = np.arange(total) - np.repeat(offsets[:-1], lengths)
    mask = (position >= np.repeat(prompt_end - offsets[:-1], lengths)).astype(np.int8)

    offsets32 = offsets.astype(np.int32)  # list<...> like step 01's columns (not large_list)
    table = pa.table({
        "sample_id": [f"synthetic:{i}" for i in range(samples)],
        "input_ids": pa.ListArray.from_arrays(offsets32, ids),
        "loss_mask": pa.ListArray.from_arrays(offsets32, mask),
        "num_tokens": lengths.astype(np.int64),
    })
    Dataset(table).save_to_disk(str(folder))
    PrepareReport(target="synthetic", tokenizer="synthetic", vocab_size=vocab_size, chat_template_sha256="",
                  max_len=MAX_LEN, inputs=["synthetic"], samples_read=samples, samples_kept=samples,
                  total_tokens=total, supervised_tokens=int(mask.sum())).save(folder)
    return total


def run(samples: int = DEFAULT_SAMPLES, repeats: int = 3) -> dict:
    """Time both counters on one synthetic set; return the figures (seconds are medians)."""
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    with tempfile.TemporaryDirectory(prefix="bench03-") as tmp:
        folder = Path(tmp) / "prepared"
        tokens = write_synthetic_prepared(folder, samples)
        ds, report = load_prepared(folder)

        ours_s, ours = median_seconds(
            lambda: count_supervised_tokens(ds, report.vocab_size, progress=False), repeats)

        runs = iter(range(repeats))  # the library returns early if its output file exists: one per run

        def library() -> dict[int, int]:
            path = save_token_frequency_distribution(ds.with_format("torch"), f"{tmp}/freq-{next(runs)}.pt")
            return torch.load(path, weights_only=True)

        lib_s, theirs = median_seconds(library, repeats)

    agree = {int(i): int(ours[i]) for i in ours.nonzero().flatten()} == theirs
    return {"samples": samples, "tokens": tokens, "supervised_tokens": int(ours.sum()), "repeats": repeats,
            "ours_s": ours_s, "speculators_s": lib_s, "speedup": lib_s / ours_s, "counts_agree": agree}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="samples in the set (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each counter (default: %(default)s)")
    args = parser.parse_args()
    r = run(args.samples, args.repeats)
    print(f"set: {r['samples']:,} samples, {r['tokens']:,} tokens, {r['supervised_tokens']:,} supervised, "
          f"vocabulary {KIMI_VOCAB_SIZE:,}")
    print(f"vocab counting: ours {r['ours_s']:.2f} s, speculators {r['speculators_s']:.1f} s, "
          f"speed-up {r['speedup']:.1f}x (median of {r['repeats']})")
    print(f"counts agree: {'yes' if r['counts_agree'] else 'NO'}")
    return 0 if r["counts_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
