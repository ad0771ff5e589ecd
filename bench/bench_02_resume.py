"""Benchmark of step 02's restart: the resume scan over an output folder of many finished files,
reading the journal (ours) against loading every file (the scan without a journal).

    python bench/bench_02_resume.py [--samples 100000] [--repeats 3]

Writes `--samples` tiny sample files (32 tokens, hidden size 8, in 02's folder layout), their
prepared rows and a journal as 02 writes it, into a temporary folder; then times `find_done`
(the whole scan: listing the folder, then deciding which files to keep) with the journal, with
`--verify` (every file re-read and its digest compared), and with the journal moved aside, which
makes it load and check every file. Both runs read a warm page cache (the files were just
written): on a cold network disk the loads cost more, the journal's one `stat` per file less.
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import pyarrow as pa
import torch
from tqdm import tqdm

from bench.timing import median_seconds
from common.hidden_states.journal import Journal, find_done, ids_digest, journal_path
from common.hidden_states.state_files import file_digest, sample_path

DEFAULT_SAMPLES = 100_000
TOKENS, HIDDEN = 32, 8
GOAL = 10.0  # the journal scan at least 10x faster


def write_folder(root: Path, samples: int):
    """`samples` finished files, all of the same 32 ids (the scan's work does not depend on the
    ids), the prepared rows, and the journal; return the prepared dataset."""
    from datasets import Dataset

    ids = torch.arange(TOKENS, dtype=torch.long)
    buffer = io.BytesIO()
    torch.save({"input_ids": ids, "hidden_states": [torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16)] * 4,
                "loss_mask": torch.ones(TOKENS, dtype=torch.long)}, buffer)
    content, digest = buffer.getvalue(), ids_digest(ids)
    root.mkdir(parents=True)
    journal = Journal(journal_path(root, 0, 1))
    data_digest = ""
    for i in tqdm(range(samples), desc="write files", unit="file", mininterval=2):
        path = sample_path(root, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        data_digest = data_digest or file_digest(path)  # every file holds the same bytes
        journal.add(i, len(content), digest, data_digest)
    journal.close()
    offsets = pa.array([TOKENS * i for i in range(samples + 1)], pa.int32())
    column = pa.ListArray.from_arrays(offsets, pa.array(list(range(TOKENS)) * samples, pa.int32()))
    return Dataset(pa.table({"input_ids": column}))


def run(samples: int = DEFAULT_SAMPLES, repeats: int = 3) -> dict:
    """Time both scans on one folder; return the figures (seconds are medians)."""
    with tempfile.TemporaryDirectory(prefix="bench02r-") as tmp:
        root = Path(tmp) / "hidden_states"
        ds = write_folder(root, samples)
        indices = set(range(samples))
        ours, (done, _) = median_seconds(lambda: find_done(root, ds, indices, HIDDEN), repeats)
        assert len(done) == samples, "the journal scan must keep every file"
        verify, (done, _) = median_seconds(lambda: find_done(root, ds, indices, HIDDEN, verify=True), repeats)
        assert len(done) == samples, "--verify must keep every intact file"
        aside = journal_path(root, 0, 1).rename(Path(tmp) / "journal.jsonl")
        reference, (done, _) = median_seconds(lambda: find_done(root, ds, indices, HIDDEN), repeats)
        assert len(done) == samples and aside.is_file(), "the loading scan must keep every file"
    return {"samples": samples, "ours_seconds": ours, "reference_seconds": reference, "ratio": reference / ours,
            "verify_seconds": verify}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    r = run(args.samples, args.repeats)
    print(f"02 resume scan of {r['samples']:,} finished files (medians of {args.repeats})")
    print(f"{'':28}{'ours (journal)':<18}{'reference (load each)':<24}{'ratio':<10}goal")
    print(f"{'seconds':<28}{r['ours_seconds']:<18.2f}{r['reference_seconds']:<24.2f}{r['ratio']:<#10.3g}>= {GOAL:g}x")
    print(f"files per second            {r['samples'] / r['ours_seconds']:<18,.0f}"
          f"{r['samples'] / r['reference_seconds']:<24,.0f}")
    print(f"02 --verify (every file re-read and its digest compared): {r['verify_seconds']:.2f}s")
    met = r["ratio"] >= GOAL
    print(f"goal {'met' if met else 'NOT met'}: {r['ratio']:#.3g}x")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
