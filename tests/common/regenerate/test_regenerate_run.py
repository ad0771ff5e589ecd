"""common/regenerate/run.py: a run over records of both forms skips bad rows and counts them by
reason."""

from __future__ import annotations

import pytest
from helpers import engine_of, greedy_target, read_regenerated

from common.regenerate.options import RegenerateOptions
from common.regenerate.run import regenerate

MAX_NEW = 40


@pytest.fixture(scope="module")
def kimi(kimi_target):
    return greedy_target(kimi_target)


def test_bad_rows_are_skipped_and_counted_and_every_format_is_read(kimi, kimi_target, tmp_path):
    data = tmp_path / "mixed.jsonl"
    rows = ['{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}',
            "{not json",
            '{"text": "no conversation"}',
            '{"messages": [{"role": "user", "content": "only a question"}]}',
            '{"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]}']
    data.write_text("\n".join(rows) + "\n")
    options = RegenerateOptions(inputs=[data], target=kimi_target, output=tmp_path / "out", temperature=0.0,
                                top_p=1.0, max_new_tokens=MAX_NEW, keep_cut=True)
    report = regenerate(options, kimi[2], engine_of(kimi, 2))
    assert report["records_read"] == 5
    assert report["dropped"] == {"malformed_record": 2, "no_assistant_turn": 1}
    assert report["regenerated"] == 2
    assert [r["id"] for r in read_regenerated(tmp_path / "out")] == [f"{data}:1", f"{data}:5"]
