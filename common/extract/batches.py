"""Step 02's plan: the prepared rows checked against the target's vocabulary, grouped into batches
and shards, and the disk their files will take.

Samples are batched by length under a padded-token budget (`plan_batches`), right-padded with
an attention mask; padding sits after every real token, so under causal attention it changes
no real position. The plan depends only on the sample lengths and the budget: shards take
every k-th batch of one global plan, and a resumed run recomputes a whole planned batch, so a
sharded or resumed run does the same arithmetic as one uninterrupted run.
"""

from __future__ import annotations

import pyarrow.compute as pc

from common.errors import PipelineError
from common.hidden_states.data_config import NUM_STATES
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES, StateStorage

DEFAULT_BATCH_TOKENS = 8192  # padded tokens per forward pass (02 and 04 --online --batch-tokens)


def check_token_ids(ds, num_rows: int, vocab_size: int) -> list[int]:
    """Lengths of the first `num_rows` rows; refuse ids outside the target's vocabulary (data
    prepared with another tokenizer), naming the first such sample."""
    table = ds.with_format("arrow")[:num_rows]
    ids = table.column("input_ids")
    bounds = pc.min_max(pc.list_flatten(ids)).as_py()
    if bounds["min"] is not None and (bounds["min"] < 0 or bounds["max"] >= vocab_size):
        row, bad = next((i, t) for i, r in enumerate(ids.to_pylist()) for t in r if not 0 <= t < vocab_size)
        sample_id = table.column("sample_id")[row].as_py()
        raise PipelineError(f"prepared sample {sample_id} (row {row}) holds token id {bad}, outside the target's "
                            f"vocabulary 0..{vocab_size - 1}: the data was prepared with another tokenizer; "
                            "re-run 01_prepare_data.py with this --target")
    return pc.list_value_length(ids).to_pylist()


def plan_batches(lengths: dict[int, int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices into batches of similar length whose padded size (batch size x
    longest sample) stays within `batch_tokens`; a longer sample gets a batch of its own.
    Longest first, so an out-of-memory batch shows up at the start of a run; ties by index."""
    batches: list[list[int]] = []
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def shard_batches(batches: list[list[int]], num_shards: int, shard_index: int) -> list[list[int]]:
    """Every `num_shards`-th batch, from `shard_index`: disjoint shards whose union is the plan."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise PipelineError(f"--shard-index {shard_index} --num-shards {num_shards}: expected 0 <= index < shards")
    return batches[shard_index::num_shards]


def estimate_bytes(tokens: int, samples: int, hidden_size: int,
                   storage: StateStorage = STORAGES[DEFAULT_STORAGE]) -> int:
    """Disk for `samples` files of `tokens` tokens in all: the four stored states (with their
    scales), the two int64 id/mask vectors, and a few kilobytes of zip and pickle overhead per file."""
    return tokens * (storage.bytes_per_token(NUM_STATES, hidden_size) + 16) + samples * 4096
