"""Fingerprints that tie each stage's output to the exact input it was made from.

prepared (01) -> hidden states (02) -> vocabulary (03) -> draft (04): 02 records the fingerprint
of the prepared dataset it read in `data_config.json`, 03 in `vocab_report.json`, 04 in the
draft's `validation_split.json` and in `train_report.json`. A stage handed outputs of different
runs of 01 (hidden states from one, vocabulary from another) refuses with one line naming both.

The prepared dataset's fingerprint is a digest of `prepare_report.json` (inputs, target,
template, counts) and of the Hugging Face dataset's own fingerprint in `state.json`, which
changes with its content: re-running 01 on other input, or with another --max-samples, into
the same folder gives a new fingerprint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from common.errors import PipelineError

PREPARED_FILES = ("prepare_report.json", "state.json")


def prepared_fingerprint(folder: str | Path) -> str:
    """16 hex characters; an error names the file that is missing."""
    digest = hashlib.sha256()
    for name in PREPARED_FILES:
        path = Path(folder) / name
        if not path.is_file():
            raise PipelineError(f"prepared dataset {folder}: no {name} (run 01_prepare_data.py again)")
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def check_same_prepared(first: tuple[str, str | Path], second: tuple[str, str | Path],
                        fingerprints: tuple[str, str]) -> None:
    """Refuse two stage outputs made from different prepared datasets. `first`/`second`:
    (what, folder); an empty fingerprint (an output of an earlier version) is not checked."""
    a, b = fingerprints
    if a and b and a != b:
        raise PipelineError(f"{first[0]} {first[1]} and {second[0]} {second[1]} come from different runs of "
                            f"01_prepare_data.py (prepared fingerprints {a} and {b}); run the stages again "
                            "from the same prepared dataset")
