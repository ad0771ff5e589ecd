"""common/extract/batches.py: step 02's plan. Batches stay within the padded-token budget, longest
first; shards split the plan into disjoint parts; ids outside the target's vocabulary are refused,
naming the sample; the disk estimate counts the stored states of each storage."""

from __future__ import annotations

import pytest
from datasets import Dataset

from common.errors import PipelineError
from common.extract.batches import check_token_ids, estimate_bytes, plan_batches, shard_batches
from common.hidden_states.storage import STORAGES


def test_plan_batches_respects_budget_and_shards_split_it():
    lengths = {i: n for i, n in enumerate([5, 40, 7, 100, 33, 40, 2, 9, 60, 12])}
    batches = plan_batches(lengths, 80)
    assert sorted(i for b in batches for i in b) == sorted(lengths)
    assert batches[0] == [3]  # longer than the budget: alone, and first
    assert all(len(b) * max(lengths[i] for i in b) <= 80 for b in batches if len(b) > 1)
    assert all(lengths[b[0]] == max(lengths[i] for i in b) for b in batches)
    shards = [shard_batches(batches, 3, j) for j in range(3)]
    flat = [i for shard in shards for b in shard for i in b]
    assert sorted(flat) == sorted(lengths) and len(flat) == len(set(flat))
    with pytest.raises(PipelineError, match="--shard-index 3 --num-shards 3"):
        shard_batches(batches, 3, 3)


def test_bytes_estimate_is_four_bf16_states_per_token():
    assert estimate_bytes(1000, 0, 7168) == 1000 * (4 * 7168 * 2 + 16)
    # fp8: one byte per value and a bf16 scale per token row of each state.
    assert estimate_bytes(1000, 0, 7168, STORAGES["fp8"]) == 1000 * (4 * (7168 + 2) + 16)


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_sample():
    rows = {"sample_id": ["a", "b", "c"], "input_ids": [[1, 2, 3], [4, 99, 5, 6], [100, 7]]}
    ds = Dataset.from_dict(rows)
    assert check_token_ids(ds, 3, 101) == [3, 4, 2]  # each row's length
    assert check_token_ids(ds, 2, 100) == [3, 4]  # only the rows this run extracts are checked
    with pytest.raises(PipelineError, match=r"^prepared sample c \(row 2\) holds token id 100, outside the "
                                            r"target's vocabulary 0\.\.99: the data was prepared with another "
                                            r"tokenizer; re-run 01_prepare_data\.py with this --target"):
        check_token_ids(ds, 3, 100)
    with pytest.raises(PipelineError, match=r"prepared sample b \(row 1\) holds token id 99"):
        check_token_ids(ds, 3, 50)
