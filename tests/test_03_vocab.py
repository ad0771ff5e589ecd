"""Step 03: supervised-token counting, the draft vocabulary maps (checked against speculators'
own functions), the output folder, and the script's errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import run_in_process, run_script
from speculators.train.vocab_mapping import (
    build_vocab_mappings_from_distribution,
    save_token_frequency_distribution,
)

from common.defaults import REPO_ROOT
from common.errors import PipelineError
from common.prepare.prepared_dataset import PrepareReport, check_prepared_target, load_prepared
from common.vocab import (
    FREQ_LAYOUT,
    build_maps,
    count_supervised_tokens,
    load_vocab,
    make_report,
    write_vocab,
)

SCRIPT = "03_build_vocab_map.py"
VOCAB = 1000  # vocabulary of the config-only target used by most tests


def write_config_target(folder: Path, vocab_size: int) -> Path:
    """A target folder holding only a Llama `config.json`: all that step 03 reads of a target."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size,
              "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_prepared(folder: Path, input_ids: list[list[int]], loss_mask: list[list[int]], target: Path,
                   vocab_size: int) -> Path:
    """A prepared folder as step 01 writes it: the saved dataset plus prepare_report.json."""
    rows = {"sample_id": [f"demo:{i}" for i in range(len(input_ids))], "input_ids": input_ids,
            "loss_mask": loss_mask, "num_tokens": [len(x) for x in input_ids]}
    Dataset.from_dict(rows).save_to_disk(str(folder))
    PrepareReport(target=str(target.resolve()), tokenizer="test", vocab_size=vocab_size,
                  chat_template_sha256="0" * 64, max_len=4096, inputs=["test"],
                  samples_kept=len(input_ids)).save(folder)
    return folder


def random_samples(n: int, vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Zipf-like ids (a few frequent tokens, a long tail) with a random half of positions supervised."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(n):
        length = int(torch.randint(1, 60, (1,), generator=g))
        ranks = torch.rand(length, generator=g).pow(3) * vocab_size
        ids.append(ranks.long().clamp_max(vocab_size - 1).tolist())
        masks.append((torch.rand(length, generator=g) < 0.5).long().tolist())
    return ids, masks


def library_maps(counts: torch.Tensor, draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' maps on the same counts, given as its sparse {id: count} dict."""
    freq = {int(i): int(counts[i]) for i in counts.nonzero().flatten()}
    return build_vocab_mappings_from_distribution(freq, draft, counts.numel())


def load_script():
    spec = importlib.util.spec_from_file_location("build_vocab_map", REPO_ROOT / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def config_target(tmp_path_factory) -> Path:
    return write_config_target(tmp_path_factory.mktemp("vocab-target"), VOCAB)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, config_target) -> Path:
    ids, masks = random_samples(200, VOCAB)
    return write_prepared(tmp_path_factory.mktemp("vocab-prepared") / "prepared", ids, masks, config_target, VOCAB)


# --- counting -------------------------------------------------------------------------------------

def test_counts_equal_library_counting(prepared, tmp_path):
    ds, _ = load_prepared(prepared)
    ds = ds.select(range(150, 3, -2))  # a reordered subset: batches are slices of the Arrow table
    ours = count_supervised_tokens(ds, VOCAB, batch_rows=7, progress=False)
    path = save_token_frequency_distribution(ds.with_format("torch"), str(tmp_path / "freq.pt"))
    theirs = torch.load(path, weights_only=True)
    assert ours.dtype == torch.int64 and ours.shape == (VOCAB,)
    assert {i: int(c) for i, c in enumerate(ours) if c} == theirs


def test_counts_only_supervised_tokens(tmp_path, config_target):
    ids = [[5, 6, 7, 5], [7, 7, 9]]
    masks = [[0, 1, 1, 1], [1, 0, 1]]
    ds, _ = load_prepared(write_prepared(tmp_path / "p", ids, masks, config_target, VOCAB))
    counts = count_supervised_tokens(ds, VOCAB, progress=False)
    assert counts.nonzero().flatten().tolist() == [5, 6, 7, 9]
    assert counts[[5, 6, 7, 9]].tolist() == [1, 1, 2, 1]


@pytest.mark.parametrize("ids, masks, message", [
    ([[1, 2], [3, VOCAB]], [[1, 1], [1, 1]], f"sample demo:1: token id {VOCAB} is outside the target vocabulary"),
    ([[1, -4]], [[0, 0]], "sample demo:0: token id -4 is outside the target vocabulary"),
    ([[1, 2], [3, 4, 5]], [[1, 1], [1, 1]], "sample demo:1: input_ids and loss_mask differ in length"),
])
def test_bad_samples_are_named(tmp_path, config_target, ids, masks, message):
    ds, _ = load_prepared(write_prepared(tmp_path / "p", ids, masks, config_target, VOCAB))
    with pytest.raises(PipelineError, match=message):
        count_supervised_tokens(ds, VOCAB, progress=False)


def test_no_supervised_tokens_is_an_error(tmp_path):
    counts = torch.zeros(10, dtype=torch.long)
    with pytest.raises(PipelineError, match="no supervised tokens"):
        make_report(counts, torch.ones(10, dtype=torch.bool), target="t", prepared=tmp_path, samples=3)


# --- the maps equal speculators' build_vocab_mappings_from_distribution ---------------------------

def _counts(values: dict[int, int], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    counts[list(values)] = torch.tensor(list(values.values()))
    return counts


MAP_CASES = {
    "fewer distinct tokens than the draft": (_counts({90: 5, 3: 2, 77: 9}, 100), 10),
    "ties broken by the lower id": (_counts({50: 4, 20: 4, 80: 4, 10: 1, 60: 4, 5: 1}, 100), 3),
    "ties at the cut filled with low ids": (_counts({i: 1 for i in range(40, 100, 3)}, 100), 7),
    "identity (draft = target)": (_counts({7: 3, 99: 1}, 100), 100),
    "identity with every id seen": (torch.arange(1, 101).flip(0), 100),
    "draft of one": (_counts({42: 1, 41: 1}, 100), 1),
    "zipf counts, many distinct": (torch.randint(0, 50, (5000,), generator=torch.Generator().manual_seed(1)), 700),
}


@pytest.mark.parametrize("counts, draft", MAP_CASES.values(), ids=MAP_CASES.keys())
def test_maps_equal_library(counts, draft):
    d2t, t2d = build_maps(counts, draft)
    lib_d2t, lib_t2d = library_maps(counts, draft)
    assert d2t.dtype == lib_d2t.dtype == torch.int64 and t2d.dtype == lib_t2d.dtype == torch.bool
    assert torch.equal(d2t, lib_d2t) and torch.equal(t2d, lib_t2d)
    assert d2t.shape == (draft,) and t2d.shape == counts.shape and int(t2d.sum()) == draft
    assert torch.equal((d2t + torch.arange(draft)), t2d.nonzero().flatten())  # target id = i + d2t[i]


def test_identity_map_is_all_zero_offsets():
    d2t, t2d = build_maps(_counts({3: 1}, 50), 50)
    assert not d2t.any() and t2d.all()


@pytest.mark.parametrize("draft, message", [(0, "must be positive"), (-3, "must be positive"),
                                            (VOCAB + 1, f"larger than the target vocabulary \\({VOCAB}\\)")])
def test_bad_draft_sizes(draft, message):
    with pytest.raises(PipelineError, match=message):
        build_maps(torch.ones(VOCAB, dtype=torch.long), draft)


def test_prepared_for_another_target_is_refused(tmp_path):
    def report(target: str, vocab: int) -> PrepareReport:
        return PrepareReport(target=target, tokenizer="T", vocab_size=vocab, chat_template_sha256="0", max_len=8,
                             inputs=[])

    with pytest.raises(PipelineError, match="vocabulary of 4096 .*target /a/x.*but target /b/y has 163840"):
        check_prepared_target(report("/a/x", 4096), tmp_path, "/b/y", 163840)
    with pytest.raises(PipelineError, match="made with target /a/x, not with the given target /b/y"):
        check_prepared_target(report("/a/x", 163840), tmp_path, "/b/y", 163840)
    check_prepared_target(report(str(tmp_path / "t" / ".." / "t"), 10), tmp_path, str(tmp_path / "t"), 10)


# --- the output folder -----------------------------------------------------------------------------

def test_write_then_load_round_trip(tmp_path):
    counts = _counts({4: 10, 8: 3, 1: 1}, 20)
    d2t, t2d = build_maps(counts, 2)
    report = make_report(counts, t2d, target="t", prepared=tmp_path, samples=2)
    assert report.coverage == pytest.approx(13 / 14) and report.distinct_tokens == 3
    assert [t["id"] for t in report.top_tokens] == [4, 8, 1]
    write_vocab(tmp_path / "vocab", d2t, t2d, counts, report)
    maps = load_vocab(tmp_path / "vocab", target_vocab_size=20)
    assert torch.equal(maps.d2t, d2t) and torch.equal(maps.t2d, t2d) and maps.report == report
    assert sorted(p.name for p in (tmp_path / "vocab").iterdir()) == [
        "d2t.pt", "t2d.pt", "token_freq.pt", "vocab_report.json"]

    torch.save(torch.zeros(20, dtype=torch.bool), tmp_path / "vocab" / "t2d.pt")
    with pytest.raises(PipelineError, match="do not describe the same draft vocabulary"):
        load_vocab(tmp_path / "vocab")
    with pytest.raises(PipelineError, match="t2d covers 20 ids, the target has 30"):
        load_vocab(tmp_path / "vocab", target_vocab_size=30)


# --- the script ------------------------------------------------------------------------------------

def test_script_writes_maps(prepared, config_target, tmp_path):
    out = tmp_path / "vocab"
    proc = run_script(SCRIPT, "--prepared", prepared, "--target", config_target, "--output", out,
                      "--draft-vocab-size", "100")
    counts = torch.load(out / "token_freq.pt", weights_only=True)
    t2d = torch.load(out / "t2d.pt", weights_only=True)
    d2t = torch.load(out / "d2t.pt", weights_only=True)
    report = json.loads((out / "vocab_report.json").read_text())

    ds, _ = load_prepared(prepared)
    expected = torch.zeros(VOCAB, dtype=torch.long)
    for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
        expected += torch.bincount(torch.tensor(ids)[torch.tensor(mask) == 1], minlength=VOCAB)
    assert torch.equal(counts, expected)
    lib_d2t, lib_t2d = library_maps(expected, 100)
    assert torch.equal(d2t, lib_d2t) and torch.equal(t2d, lib_t2d)
    assert report["target"] == str(config_target.resolve()) and report["prepared"] == str(prepared.resolve())
    assert (report["target_vocab_size"], report["draft_vocab_size"], report["samples"]) == (VOCAB, 100, 200)
    assert report["supervised_tokens"] == int(expected.sum())
    assert report["distinct_tokens"] == int((expected > 0).sum())
    assert report["coverage"] == pytest.approx(int(expected[t2d].sum()) / int(expected.sum()))
    assert report["top_tokens"][0] == {"id": int(expected.argmax()), "count": int(expected.max()),
                                       "share": pytest.approx(int(expected.max()) / int(expected.sum()))}
    assert report["token_freq_layout"] == FREQ_LAYOUT and report["identity"] is False
    assert "draft vocabulary: 100 of 1,000 ids, coverage" in proc.stdout
    assert f"to {out}" in proc.stdout


def test_script_error_is_one_line_exit_1(prepared, config_target, tmp_path):
    other = write_config_target(tmp_path / "other", 2000)
    proc = run_in_process(SCRIPT, "--prepared", prepared, "--target", other, "--output", tmp_path / "v")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: prepared dataset {prepared} was made for a vocabulary of {VOCAB} "
        f"(target {config_target.resolve()}), but target {other.resolve()} has 2000; re-run 01_prepare_data.py with this target"]
    assert not (tmp_path / "v").exists()


def test_script_defaults_to_the_target_vocabulary_when_smaller(prepared, config_target, tmp_path):
    load_script().main(["--prepared", str(prepared), "--target", str(config_target), "--output", str(tmp_path / "v")])
    report = json.loads((tmp_path / "v" / "vocab_report.json").read_text())
    assert report["draft_vocab_size"] == VOCAB and report["identity"] is True and report["coverage"] == 1.0


@pytest.mark.parametrize("extra, message", [
    (["--draft-vocab-size", "0"], "--draft-vocab-size 0: must be positive"),
    (["--draft-vocab-size", str(VOCAB + 1)], f"--draft-vocab-size {VOCAB + 1}: larger than the target"),
    (["--batch-rows", "0"], "--batch-rows 0: must be positive"),
])
def test_script_rejects_bad_flags(prepared, config_target, tmp_path, extra, message):
    argv = ["--prepared", str(prepared), "--target", str(config_target), "--output", str(tmp_path / "v"), *extra]
    with pytest.raises(PipelineError, match=message):
        load_script().main(argv)


@pytest.mark.parametrize("rows_saved", [False, True], ids=["saved with no rows", "every row filtered out"])
def test_script_rejects_empty_dataset(tmp_path, config_target, rows_saved):
    full = write_prepared(tmp_path / "full", [[1, 2]] if rows_saved else [], [[0, 1]] if rows_saved else [],
                          config_target, VOCAB)
    empty = tmp_path / "empty"
    if rows_saved:  # a one-shard dataset with zero rows, as a filter that drops everything leaves it
        ds, report = load_prepared(full)
        ds.filter(lambda _: False).save_to_disk(str(empty))
        report.save(empty)
    else:
        full.rename(empty)
    with pytest.raises(PipelineError, match=f"prepared dataset {empty}: it holds no samples"):
        load_script().main(["--prepared", str(empty), "--target", str(config_target), "--output", str(tmp_path / "v")])


@pytest.mark.slow
def test_prepare_then_vocab_on_kimi_target(kimi_target, demo_conversations, tmp_path):
    prepared, out = tmp_path / "prepared", tmp_path / "vocab"
    run_in_process("01_prepare_data.py", "--input", demo_conversations, "--target", kimi_target,
                   "--trust-remote-code", "--output", prepared, check=True)
    run_script(SCRIPT, "--prepared", prepared, "--target", kimi_target, "--trust-remote-code", "--output", out)
    maps = load_vocab(out, target_vocab_size=163840)
    counts = torch.load(out / "token_freq.pt", weights_only=True)
    assert maps.d2t.shape == (32000,) and counts.shape == (163840,) and counts.dtype == torch.int64
    lib_d2t, lib_t2d = library_maps(counts, 32000)
    assert torch.equal(maps.d2t, lib_d2t) and torch.equal(maps.t2d, lib_t2d)
    im_end, im_user = 163586, 163587  # ends every assistant turn / never supervised
    assert maps.t2d[im_end] and counts[im_end] > 0 and counts[im_user] == 0
    # Fewer distinct supervised ids than 32000: every one is kept, the rest are the lowest unused ids.
    assert maps.report.coverage == 1.0 and maps.report.distinct_tokens < 32000
    assert maps.report.supervised_tokens == json.loads((prepared / "prepare_report.json").read_text())["supervised_tokens"]

    load_script().main(["--prepared", str(prepared), "--target", str(kimi_target), "--trust-remote-code",
                        "--output", str(tmp_path / "identity"), "--draft-vocab-size", "163840"])
    identity = load_vocab(tmp_path / "identity")
    assert identity.report.identity and identity.t2d.all() and not identity.d2t.any()
