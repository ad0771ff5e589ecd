"""Step 04 --online: the target computes each batch's hidden states while the draft trains.

One module run on the flat miniature target: 01's prepared rows (random ids), 02 and 03, 04 offline
on 02's files and 04 --online on the same rows with the same settings. The target runs one sample
per forward pass in both (--batch-tokens 1), so the states are the same bits and so must the drafts be.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import kill_after_step_checkpoint, run_in_process, run_script, tensorboard_scalars, write_prepared

from common.defaults import REPO_ROOT
from common.draft.model import TINY_CONFIG
from common.extract import hf_engine as capture
from common.hidden_states.loader import load_hidden_states
from common.hidden_states.state_files import list_sample_files, sample_path
from common.train.metrics import read_log

SCRIPT = "04_train.py"
SAMPLES = 60
ONLINE = ("--online", "--batch-tokens", "1")  # as 02 ran: one sample per forward pass


@dataclass
class Runs:
    target: Path
    offline: Path  # 01 (random rows), 02 --batch-tokens 1, 03, then 04 on 02's files
    online: Path  # 04 --online over the offline run's prepared rows and vocabulary
    online_stdout: str

    def args(self, run: Path, *extra: str | Path) -> list[str | Path]:
        """04 on `run` with the offline run's prepared rows and vocabulary: 2 epochs of ~17 steps."""
        return ["--run-dir", run, "--target", self.target, "--draft-config", TINY_CONFIG,
                "--vocab", self.offline / "vocab", "--epochs", "2", "--total-seq-len", "64", "--val-ratio", "0.2",
                "--noise-std", "0.05", "--save-every", "5", *extra]

    def online_args(self, run: Path, *extra: str | Path) -> list[str | Path]:
        return self.args(run, *ONLINE, "--prepared", self.offline / "prepared", *extra)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_same_draft(run: Path, reference: Path) -> None:
    """Bitwise-equal exported draft and last fp32 checkpoint, and the same log step by step (an online
    run's report steps also hold the seconds it waited for states, a timing of its own)."""
    for name in ("draft/model.safetensors", "checkpoints/1/model.safetensors"):
        assert sha256(run / name) == sha256(reference / name), name

    def without_waits(path: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "state_wait_seconds"} for r in read_log(path)]

    assert without_waits(run / "train_log.jsonl") == without_waits(reference / "train_log.jsonl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, flat_target) -> Runs:
    offline, online = tmp_path_factory.mktemp("offline04"), tmp_path_factory.mktemp("online04")
    common = ["--run-dir", offline, "--target", flat_target]
    write_prepared(offline / "prepared", flat_target, SAMPLES)
    run_in_process("02_extract_hidden_states.py", *common, "--batch-tokens", "1", check=True)
    run_in_process("03_build_vocab_map.py", *common, check=True)
    partial = Runs(flat_target, offline, online, "")
    run_in_process(SCRIPT, *partial.args(offline), check=True)
    stdout = run_script(SCRIPT, *partial.online_args(online), env={"OMP_NUM_THREADS": "1"}).stdout
    return Runs(flat_target, offline, online, stdout)


@pytest.mark.slow
def test_online_draft_is_bitwise_the_offline_draft(runs):
    """Same rows, split, packing, noise draws and states: the same draft, with nothing of the
    states written to disk (the run folder holds 04's outputs alone)."""
    assert_same_draft(runs.online, runs.offline)
    train_samples = SAMPLES - int(SAMPLES * 0.2)
    report = json.loads((runs.online / "train_report.json").read_text())
    assert report["online"]["computed_samples"] == 2 * SAMPLES  # every row, each epoch (training and validation)
    assert report["online"]["kept_samples"] == 0 and report["train_samples"] == train_samples
    assert set(report["state_wait_seconds"]) == {"1", "2"}
    assert "waited" in runs.online_stdout and "computed the states of 120 samples" in runs.online_stdout
    split = json.loads((runs.online / "draft" / "validation_split.json").read_text())
    offline_split = json.loads((runs.offline / "draft" / "validation_split.json").read_text())
    assert split["validation_rows"] == offline_split["validation_rows"]
    assert sorted(p.name for p in runs.online.iterdir()) == ["checkpoints", "draft", "tensorboard", "train_log.jsonl",
                                                             "train_log.png", "train_report.json"]
    curves = tensorboard_scalars(runs.online / "tensorboard" / "train")
    assert curves["train/state_wait_share"] and all(0 <= share <= 1 for _, share in curves["train/state_wait_share"])
    assert [s for s, _ in curves["online/computed_samples"]] == [s for s, _ in curves["train/loss"]][-1:]
    assert not list(runs.online.rglob("data_*.pt"))


@pytest.mark.slow
def test_online_resume_after_sigkill_equals_the_uninterrupted_run(runs, tmp_path):
    kill_after_step_checkpoint([sys.executable, REPO_ROOT / SCRIPT, *runs.online_args(tmp_path)],
                               tmp_path / "checkpoints" / "steps")
    resumed = run_script(SCRIPT, *runs.online_args(tmp_path, "--resume"), env={"OMP_NUM_THREADS": "1"}).stdout
    assert "resuming after step checkpoint" in resumed
    assert_same_draft(tmp_path, runs.online)


@pytest.mark.slow
def test_max_disk_keeps_02_files_up_to_the_budget(runs, tmp_path):
    """The first rows computed are kept as 02's files (the same bytes 02 wrote), within the budget;
    the folder reads as 02's, and the draft is the one trained without a disk."""
    offline_bytes = sum(p.stat().st_size for p in list_sample_files(runs.offline / "hidden_states").values())
    budget = offline_bytes // 2
    out = run_in_process(SCRIPT, *runs.online_args(tmp_path, "--max-disk", str(budget)), check=True).stdout
    kept = list_sample_files(tmp_path / "hidden_states")
    used = sum(p.stat().st_size for p in kept.values())
    assert 0.9 * budget < used <= budget and 0 < len(kept) < SAMPLES
    assert f"{len(kept)} samples kept in {tmp_path / 'hidden_states'}" in out
    for row, path in kept.items():
        mine = torch.load(path, weights_only=True)
        theirs = torch.load(sample_path(runs.offline / "hidden_states", row), weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(mine["hidden_states"], theirs["hidden_states"], strict=True))
        assert torch.equal(mine["input_ids"], theirs["input_ids"]) and torch.equal(mine["loss_mask"], theirs["loss_mask"])
    data = load_hidden_states(tmp_path / "hidden_states")
    assert {p.name for p in data.files} == {p.name for p in kept.values()}
    assert_same_draft(tmp_path, runs.online)
    report = json.loads((tmp_path / "train_report.json").read_text())
    assert report["online"]["kept_bytes"] == used
    assert report["online"]["computed_samples"] == 2 * SAMPLES - len(kept)  # the second epoch read the kept ones


@pytest.mark.slow
def test_max_disk_run_killed_and_resumed_reads_its_kept_files(runs, tmp_path):
    """A run killed before its first pass ended left kept files without sample_lengths.json: the
    resumed run takes the folder as its own (its manifest), reads them, and trains the same draft. A
    folder of another prepared dataset is refused, not trained on."""
    budget = str(sum(p.stat().st_size for p in list_sample_files(runs.offline / "hidden_states").values()) // 2)
    kill_after_step_checkpoint([sys.executable, REPO_ROOT / SCRIPT, *runs.online_args(tmp_path, "--max-disk", budget)],
                               tmp_path / "checkpoints" / "steps")
    assert list_sample_files(tmp_path / "hidden_states")  # kept before the kill
    run_in_process(SCRIPT, *runs.online_args(tmp_path, "--max-disk", budget, "--resume"), check=True)
    assert_same_draft(tmp_path, runs.online)
    config = json.loads((tmp_path / "hidden_states" / "data_config.json").read_text())
    config["prepared_fingerprint"] = "another"
    (tmp_path / "hidden_states" / "data_config.json").write_text(json.dumps(config))
    refused = run_in_process(SCRIPT, *runs.online_args(tmp_path, "--max-disk", budget))
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 1 and last.startswith(f"error: {tmp_path / 'hidden_states'} holds hidden states of "
                                                       "another prepared dataset"), last
    assert (tmp_path / "draft").is_dir()  # refused before anything was moved aside


@pytest.mark.slow
def test_engine_failure_names_the_engine_and_the_last_checkpoint_and_resume_continues(runs, tmp_path, monkeypatch):
    """The engine fails (here: raises on its 40th forward pass, in epoch 1) and the run ends in one
    line naming it and the checkpoint to resume from; --resume then trains what the run would have."""
    calls = {"n": 0}
    forward = capture.StateExtractor.__call__

    def failing(self, id_lists):
        calls["n"] += 1
        if calls["n"] == 40:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return forward(self, id_lists)

    monkeypatch.setattr(capture.StateExtractor, "__call__", failing)
    failed = run_in_process(SCRIPT, *runs.online_args(tmp_path))
    monkeypatch.undo()
    last = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode == 1
    assert last.startswith("error: the target's engine (cpu, float32) failed computing the hidden states of "
                           "prepared rows "), last
    assert "illegal memory access" in last and "run again with --resume" in last
    assert f"the last checkpoint kept is {tmp_path / 'checkpoints' / 'steps'}" in last
    run_in_process(SCRIPT, *runs.online_args(tmp_path, "--resume"), check=True)
    assert_same_draft(tmp_path, runs.online)


@pytest.mark.slow
def test_out_of_memory_batch_is_split_and_a_sample_that_fails_alone_is_skipped(runs, tmp_path, monkeypatch):
    """As in 02: a batch out of memory is run again in halves; a sample out of memory alone is
    skipped, counted and named (once, not retried in later epochs); the others train."""
    bad = 7
    bad_ids = [int(t) for t in load_row_ids(runs.offline / "prepared", bad)]
    sizes: list[int] = []
    forward = capture.StateExtractor.__call__

    def out_of_memory(self, id_lists):
        sizes.append(len(id_lists))
        if bad_ids in id_lists:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(self, id_lists)

    monkeypatch.setattr(capture.StateExtractor, "__call__", out_of_memory)
    done = run_in_process(SCRIPT, *runs.args(tmp_path, "--online", "--prepared", runs.offline / "prepared",
                                             "--batch-tokens", "400"), check=True)
    monkeypatch.undo()
    assert max(sizes) > 1  # the engine ran batches of several samples, the bad one's split down to it alone
    report = json.loads((tmp_path / "train_report.json").read_text())
    assert list(report["online"]["failed_rows"]) == [str(bad)]
    assert "OutOfMemoryError" in report["online"]["failed_rows"][str(bad)]
    assert list(report["skipped_files"]) == [f"prepared row {bad}"]
    assert "skipped 1 of 60 samples that could not be used" in done.stdout
    assert f"warning: skipped prepared row {bad}: its states could not be computed" in done.stderr


def load_row_ids(prepared: Path, row: int) -> list[int]:
    from datasets import load_from_disk

    return load_from_disk(str(prepared))[row]["input_ids"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefetch", "2"], "error: --prefetch needs --online (04 reads 02's files otherwise)"),
    (["--engine", "vllm"], "error: --engine needs --online (04 reads 02's files otherwise)"),
    (["--online", "--data", "somewhere"], "error: --data somewhere: --online computes the hidden states"),
    (["--online", "--prefetch", "0"], "error: --prefetch 0: must be at least 1"),
    (["--online", "--max-disk", "5 parsecs"], "error: --max-disk '5 parsecs': expected a size"),
    (["--online", "--gpu-memory-utilization", "0.5"], "error: --gpu-memory-utilization 0.5: a share in (0, 1) of "
                                                      "each GPU for --engine vllm"),
])
def test_online_flags_are_checked(flat_target, tmp_path, flags, message):
    done = run_in_process(SCRIPT, "--run-dir", tmp_path, "--target", flat_target, "--draft-config", TINY_CONFIG,
                          *flags)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(message), done.stderr


@pytest.mark.slow
def test_05_on_an_online_run_measures_without_hidden_states(runs, tmp_path):
    """05 on the online run folder (no RUN/hidden_states): one line says the offline figures are
    skipped; the measured acceptance length on the held-out rows is what 05 measures for the same
    draft trained offline (where it also has the offline figures)."""
    flags = ["--target", runs.target, "--prepared", runs.offline / "prepared", "--max-prompts", "3",
             "--max-new-tokens", "12", "--no-baselines"]
    online = run_in_process("05_evaluate.py", "--run-dir", runs.online, *flags, "--json", tmp_path / "online.json",
                            check=True)
    offline = run_in_process("05_evaluate.py", "--run-dir", runs.offline, *flags, "--json", tmp_path / "offline.json",
                             check=True)
    assert f"offline metrics skipped: no hidden states at {runs.online / 'hidden_states'}" in online.stdout
    assert "offline metrics skipped" not in offline.stdout
    mine, theirs = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("online", "offline"))
    assert mine["simulated_acceptance_length"] is None and theirs["simulated_acceptance_length"] is not None
    assert mine["measured_acceptance_length"] == theirs["measured_acceptance_length"] >= 1.0
    assert mine["prompts"] == theirs["prompts"] == 3 and mine["identical_to_greedy"] is True
