"""Fault drills: the numbered scripts run against broken input, a broken environment and
interruptions, one catalog entry per fault: as real subprocesses, or, for a refusal that needs no
signal, resource limit or lock, as their `main` inside the test's process (`Fault.in_process`).

Every case checks three things: the exit status (or, for a kill drill, that the restart
succeeds), one line on stderr naming the cause (the file, flag or sample; no traceback; for a
run that goes on, a `warning:` line naming what was skipped), and
that nothing already written was lost or corrupted: the case's whole run folder is hashed
before and after, every file present before must be unchanged (except those the case names
as rewritten), and a new file may appear only where the case allows it or under a temporary
`.tmp-*` name.

The shared inputs (01 -> 02 -> 03 on a few demo conversations, Kimi-style miniature target;
for the cases on a trained run, 04 for one epoch on top) are made once per session; each case
works on its own copy. The subprocess cases run in a pool of FAULT_JOBS worker threads (default:
the usable cores, at least 2), each case a few script runs; the test of a case reports its outcome
(and runs an in-process case itself, meanwhile).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import (
    BATCH_TOKENS,
    assert_same_files,
    export_untrained,
    extract_args,
    folder_digest,
    run_in_process,
    run_script,
    write_hidden_states,
    write_prepared,
)

from common.atomic import TMP_PREFIX
from common.defaults import REPO_ROOT
from common.draft.model import TINY_CONFIG
from common.hidden_states.data_config import SAMPLE_LENGTHS, DataConfig
from common.hidden_states.folder_lock import LOCK_FORMAT
from common.hidden_states.state_files import is_valid_sample, list_sample_files, sample_path

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1"}  # one compute thread per process: several share 2 cores
JOBS = int(os.environ.get("FAULT_JOBS", max(2, len(os.sched_getaffinity(0)))))  # cases run at once
SAMPLES = 24  # conversations in the shared run
MAX_LEN = 128
DRAFT_VOCAB = 256
EPOCHS = 2
SEQ = 128  # --total-seq-len: short packed sequences, many steps per epoch
TIMEOUT = 300  # seconds for one script run

PREPARE, EXTRACT, VOCAB, TRAIN, EVALUATE = ("01_prepare_data.py", "02_extract_hidden_states.py",
                                            "03_build_vocab_map.py", "04_train.py", "05_evaluate.py")
INTERRUPTED = r"^interrupted: finished files are kept"
TERMINATED = r"^terminated: finished files are kept"


# --- the shared run and each case's copy ------------------------------------------------------


@dataclass(frozen=True)
class Workspace:
    """One case's folder: `run` is its own copy of the shared run folder (prepared/,
    hidden_states/, vocab/); `reference` is the shared run itself, never written to."""

    root: Path
    run: Path
    reference: Path
    kimi: Path
    flat: Path

    def prepare(self, *extra) -> list:
        return ["--run-dir", self.run, "--target", self.kimi, "--trust-remote-code", "--max-len", MAX_LEN, *extra]

    def extract(self, out: str | Path = "hidden_states", *extra, target: Path | None = None,
                prepared: str = "prepared") -> list:
        """02's arguments; `out` and `prepared` are relative to the run folder (or absolute)."""
        return extract_args(self.run / prepared, target or self.kimi, self.run / out, *map(str, extra))

    def evaluate(self, *extra) -> list:
        return ["--run-dir", self.run, "--target", self.kimi, "--trust-remote-code", "--max-prompts", 1,
                "--max-new-tokens", 4, *extra]

    def train(self, *extra) -> list:
        return ["--run-dir", self.run, "--target", self.kimi, "--trust-remote-code", "--draft-config", TINY_CONFIG,
                "--epochs", EPOCHS, "--total-seq-len", SEQ, *extra]


@pytest.fixture(scope="session", autouse=True)
def sigint_delivered() -> Iterator[None]:
    """The SIGINT drills test what Ctrl-C does, so their scripts must start with SIGINT's default
    disposition. A process launched in the background by a non-interactive shell (`pytest &`)
    inherits SIGINT ignored, and so would every script it starts: exec keeps an ignored signal
    but resets a handled one to the default, so handling it here gives the children the default."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, shared_run, kimi_target) -> Path:
    """The shared run with 04 trained for one epoch of the drills' two (checkpoints/0, draft/,
    log and report): the base of the resume and evaluation cases."""
    run = Path(shutil.copytree(shared_run, tmp_path_factory.mktemp("faults-trained") / "run"))
    run_in_process(TRAIN, "--run-dir", run, "--target", kimi_target, "--trust-remote-code", "--draft-config",
                   TINY_CONFIG, "--epochs", 1, "--total-seq-len", SEQ, check=True)
    return run


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory, kimi_target, demo_conversations) -> Path:
    """01 -> 02 -> 03 on a few demo conversations; 02 with the batch budget every 02 case uses,
    so a resumed run can be compared with it file for file."""
    run = tmp_path_factory.mktemp("faults") / "run"
    common = ["--run-dir", run, "--target", kimi_target, "--trust-remote-code"]
    run_in_process(PREPARE, *common, "--input", demo_conversations, "--max-samples", SAMPLES, "--max-len", MAX_LEN,
                   check=True)
    run_in_process(EXTRACT, *common, "--batch-tokens", BATCH_TOKENS, check=True)
    run_in_process(VOCAB, *common, "--draft-vocab-size", DRAFT_VOCAB, check=True)
    return run


# --- the catalog ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interrupt:
    """Send `signal` once `ready(run folder)` holds; a SIGKILL is followed by a restart."""

    signal: signal.Signals
    ready: Callable[[Path], bool]
    restart: tuple = ()  # extra arguments of the restart (e.g. --resume)


@dataclass(frozen=True)
class Fault:
    name: str
    script: str
    setup: Callable[[Workspace], list]  # breaks something in the case's folder; returns the arguments
    status: int  # exit status of the run (of the restart, for a SIGKILL drill)
    stderr: str | None  # regex the last stderr line must match (None: a successful restart)
    may_change: tuple[str, ...] = ()  # run-folder paths (fnmatch) the run may rewrite
    may_add: tuple[str, ...] = ()  # run-folder paths (fnmatch) the run may create under a final name
    interrupt: Interrupt | None = None
    check: Callable[[Workspace, subprocess.CompletedProcess], None] | None = None  # further assertions
    trained: bool = False  # the case starts from the trained run (04's checkpoint 0, draft, log, report)
    file_size_limit: int | None = None  # RLIMIT_FSIZE of the script, bytes (`ulimit -f`: EFBIG past it)
    moved_to: str | None = None  # run-folder glob where files that left their place must be, unchanged
    own_process: bool = False  # run as a subprocess even where a refusal could run in process (see in_process)

    @property
    def in_process(self) -> bool:
        """A refusal (exit 1) or a run that goes on past a skip (exit 0) with no signal or resource limit:
        the script's `main` runs in the test's process (`run_in_process`, ~8 s of imports less per case).
        One refusal per script, and the lock drill, keep a process of their own, so the `__main__` path
        stays covered end to end (each script's successful runs as a process are in its own tests)."""
        return (self.status in (0, 1) and self.interrupt is None and self.file_size_limit is None
                and not self.own_process)


def is_temporary(rel: str) -> bool:
    """A temporary, or 02's shard lock (left by a killed run, removed by the next one's exit): not an output."""
    name = Path(rel).name
    return any(part.startswith(TMP_PREFIX) for part in Path(rel).parts) or fnmatch.fnmatch(
        name, LOCK_FORMAT.format(shard="*", shards="*"))


def matches(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


# The experiment trackers' folders (common/trackers.py; TensorBoard by default): event logs appended as a
# run goes, not stage outputs that a later stage trusts, so any run may add to them under final names.
TRACKER_OUTPUTS = ("*tensorboard/*", "*wandb/*")


# setups: each returns the script's arguments


def write_text(ws: Workspace, name: str, text: str) -> Path:
    path = ws.root / name
    path.write_text(text)
    return path


def conversations_file(ws: Workspace, name: str, text: str) -> list:
    return ws.prepare("--input", write_text(ws, name, text), "--output", ws.run / "new_prepared")


def large_input(ws: Workspace) -> list:
    """The demo conversations ten times over: long enough to be interrupted while reading."""
    text = (REPO_ROOT / "data" / "demo_conversations.jsonl").read_text()
    return conversations_file(ws, "large.jsonl", text * 10)


def target_without_weights(ws: Workspace) -> list:
    target = shutil.copytree(ws.kimi, ws.root / "no_weights", ignore=shutil.ignore_patterns("*.safetensors*"))
    return ws.extract("new_hidden_states", target=target)


def target_not_causal_lm(ws: Workspace) -> list:
    (ws.root / "vit").mkdir()
    write_text(ws, "vit/config.json", json.dumps({"model_type": "vit", "architectures": ["ViTModel"],
                                                  "hidden_size": 64, "num_hidden_layers": 2}))
    return ws.extract("new_hidden_states", target=ws.root / "vit")


def output_of_other_target(ws: Workspace) -> list:
    """A prepared folder that fits the flat target, extracted into the Kimi target's states."""
    write_prepared(ws.run / "flat_prepared", ws.flat, 4)
    return ws.extract("hidden_states", target=ws.flat, prepared="flat_prepared")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def last_data_file(ws: Workspace) -> Path:
    """The data file the library reads last (04 checks the first one itself)."""
    return sample_path(ws.run / "hidden_states", max(list_sample_files(ws.run / "hidden_states")))


def truncated_then_extract(ws: Workspace) -> list:
    truncate(sample_path(ws.run / "hidden_states", 5))
    return ws.extract()


def truncated_then_train(ws: Workspace) -> list:
    truncate(last_data_file(ws))
    return ws.train()


def stray_pt(ws: Workspace) -> list:
    shutil.copy(ws.run / "vocab" / "t2d.pt", ws.run / "hidden_states" / "00000" / "t2d.pt")
    return ws.train()


def short_t2d(ws: Workspace) -> list:
    t2d = torch.load(ws.run / "vocab" / "t2d.pt", weights_only=True)
    torch.save(t2d[:5000], ws.run / "vocab" / "t2d.pt")
    return ws.train()


def data_of_other_hidden_size(ws: Workspace) -> list:
    write_hidden_states(ws.run / "hidden_states_32", ws.kimi, num_samples=4, hidden=32)
    return ws.train("--data", ws.run / "hidden_states_32")


def draft_of_flat_target(ws: Workspace) -> list:
    export_untrained(ws.flat, ws.run / "draft")
    return ws.evaluate()


def draft_weights_cut_short(ws: Workspace) -> list:
    truncate(export_untrained(ws.kimi, ws.run / "draft") / "model.safetensors")
    return ws.evaluate()


def torn_json(path: str, args: Callable[[Workspace], list]) -> Callable[[Workspace], list]:
    """Cut one of the run's JSON files short (as a full disk or a killed copy would)."""
    def setup(ws: Workspace) -> list:
        (ws.run / path).write_text((ws.run / path).read_text()[:40])
        return args(ws)
    return setup


def mounted_tmpfs(ws: Workspace, size: str) -> Path:
    """A tmpfs of `size` at RUN/mnt (needs root with CAP_SYS_ADMIN; skipped otherwise)."""
    mount = ws.run / "mnt"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip()}); "
                    "test_02_extract.py::test_disk_check_refuses_a_small_disk covers check_disk in process")
    return mount


def small_disk(ws: Workspace) -> list:
    return ws.extract(mounted_tmpfs(ws, "1m") / "hidden_states")


def full_disk(ws: Workspace) -> list:
    return ws.extract(mounted_tmpfs(ws, "1m") / "hidden_states", "--skip-disk-check")


def read_only_output(ws: Workspace) -> list:
    """An existing, empty output folder nobody may write into. Root ignores permission bits,
    so as root the folder is made immutable (`chattr +i`, which binds root too)."""
    out = ws.run / "read_only"
    out.mkdir()
    if os.geteuid() == 0:
        proc = subprocess.run(["chattr", "+i", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot make a folder immutable here: {proc.stderr.strip()}")
    else:
        out.chmod(0o555)
    try:
        (out / "probe").touch()
    except OSError:
        return ws.extract(out)
    pytest.skip(f"{out} stayed writable")


def restore_environment(ws: Workspace) -> None:
    """Undo `read_only_output`, `mounted_tmpfs` and `second_extract_while_first_runs` so the
    folder can be checked and removed."""
    first = RUNNING.pop(ws.root, None)
    if first is not None:
        first.kill()
        first.wait()
    folder, mount = ws.run / "read_only", ws.run / "mnt"
    if folder.is_dir() and os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=False)
    elif folder.is_dir():
        folder.chmod(0o755)
    if os.path.ismount(mount):
        subprocess.run(["umount", str(mount)], check=False)


DEMO_LINES = (REPO_ROOT / "data" / "demo_conversations.jsonl").read_bytes().splitlines(keepends=True)[:6]


def conversations_bytes(ws: Workspace, name: str, data: bytes) -> list:
    path = ws.root / name
    path.write_bytes(data)
    return ws.prepare("--input", path, "--output", ws.run / "new_prepared")


def input_folder_with_config(ws: Workspace) -> list:
    """A folder of conversations that also holds a model's config.json (copied along by habit)."""
    folder = ws.root / "inputs"
    folder.mkdir()
    (folder / "chats.jsonl").write_bytes(b"".join(DEMO_LINES))
    shutil.copy(ws.kimi / "config.json", folder / "config.json")
    return ws.prepare("--input", folder, "--output", ws.run / "new_prepared")


def damage_in_place(path: Path) -> None:
    """Bytes of a data file's zip directory overwritten, its size kept (a bad sector, a torn copy
    over an old file): it no longer loads, and nothing in its size gives it away."""
    data = bytearray(path.read_bytes())
    data[-200:-100] = b"\xff" * 100
    path.write_bytes(bytes(data))


def damage_state_bytes(path: Path) -> None:
    """One byte in the middle of a data file's states flipped: it still loads, other values."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def damaged_then_verify(ws: Workspace) -> list:
    damage_state_bytes(sample_path(ws.run / "hidden_states", 5))
    return ws.extract("hidden_states", "--verify")


def garbled_journal(ws: Workspace) -> list:
    journal = next((ws.run / "hidden_states").glob("extract_journal_*.txt"))
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[3] = b"\xff\xfe\x00 not a journal line\n"
    journal.write_bytes(b"".join(lines))
    return ws.extract()


def target_with_torn_index(ws: Workspace) -> list:
    target = Path(shutil.copytree(ws.kimi, ws.root / "torn_index"))
    index = target / "model.safetensors.index.json"
    index.write_text(index.read_text()[:60])
    return ws.extract("new_hidden_states", target=target)


RUNNING: dict[Path, subprocess.Popen] = {}  # a first 02 held stopped while a case runs a second one


def second_extract_while_first_runs(ws: Workspace) -> list:
    """A first 02 into a new folder, stopped (SIGSTOP) once it holds its lock; the case's run is
    a second, identical 02. `restore_environment` kills the first."""
    args = ws.extract("new_hidden_states")
    first = subprocess.Popen([sys.executable, str(REPO_ROOT / EXTRACT), *map(str, args)], cwd=REPO_ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **ENV})
    RUNNING[ws.root] = first
    lock = ws.run / "new_hidden_states" / ".extract_lock_0_of_1"
    deadline = time.monotonic() + TIMEOUT
    while not (lock.is_file() and lock.read_text()):
        assert first.poll() is None and time.monotonic() < deadline, "the first 02 never took its lock"
        time.sleep(0.02)
    first.send_signal(signal.SIGSTOP)
    return args


def truncated_arrow(ws: Workspace) -> list:
    truncate(next((ws.run / "prepared").glob("*.arrow")))
    return ["--run-dir", ws.run, "--target", ws.kimi, "--trust-remote-code", "--output", ws.run / "new_vocab"]


def damaged_then_train(damage: Callable[[Path], None]) -> Callable[[Workspace], list]:
    def setup(ws: Workspace) -> list:
        damage(last_data_file(ws))
        return ws.train()
    return setup


def nan_in_states(path: Path) -> None:
    sample = torch.load(path, weights_only=True)
    sample["hidden_states"][1][3, 5] = float("nan")
    torch.save(sample, path)


def many_truncated_then_train(ws: Workspace) -> list:
    for i in range(11):  # one more than the limit (1% of 24 files, at least 10)
        truncate(sample_path(ws.run / "hidden_states", i))
    return ws.train()


def resume_with(*flags) -> Callable[[Workspace], list]:
    return lambda ws: ws.train("--resume", *flags)


def truncated_checkpoint(ws: Workspace) -> list:
    truncate(ws.run / "checkpoints" / "0" / "optimizer_state_dict.pt")
    return ws.train("--resume")


def prepared_again(ws: Workspace) -> list:
    """01 run again into the run's prepared folder, on fewer conversations: not the data 04 split."""
    run_script(PREPARE, *ws.prepare("--input", REPO_ROOT / "data" / "demo_conversations.jsonl",
                                    "--max-samples", SAMPLES - 4), env=ENV)
    return ws.evaluate("--offline-only")


def copied_run_folder(ws: Workspace) -> list:
    """The whole run folder copied elsewhere (another disk, a colleague's machine), evaluated there."""
    copy = Path(shutil.copytree(ws.run, ws.root / "copied"))
    return ["--run-dir", copy, *ws.evaluate("--offline-only")[2:]]


def damaged_held_out_file(ws: Workspace) -> list:
    split = json.loads((ws.run / "draft" / "validation_split.json").read_text())
    damage_in_place(sample_path(ws.run / "hidden_states", split["validation_rows"][0]))
    return ws.evaluate("--offline-only", "--json", ws.root / "eval.json")


# ready conditions of the interrupt drills


def has_data_files(folder: str) -> Callable[[Path], bool]:
    return lambda run: any((run / folder).rglob("data_*.pt"))


def has_resume_folder(run: Path) -> bool:
    return any(run.glob(f"{TMP_PREFIX}new_prepared.resume/*"))


def has_trained_a_step(run: Path) -> bool:
    log = run / "train_log.jsonl"
    return log.is_file() and '"train"' in log.read_text()


def has_checkpoint_0(run: Path) -> bool:
    return (run / "checkpoints" / "0").is_dir()


# further checks


def same_as_reference(folder: str) -> Callable[[Workspace, subprocess.CompletedProcess], None]:
    def check(ws: Workspace, _proc: subprocess.CompletedProcess) -> None:
        assert_same_files(ws.run / folder, ws.reference / "hidden_states")
        lengths = ws.reference / "hidden_states" / SAMPLE_LENGTHS
        assert (ws.run / folder / SAMPLE_LENGTHS).read_text() == lengths.read_text()
    return check


def redone_one_file(ws: Workspace, proc: subprocess.CompletedProcess) -> None:
    assert f"{SAMPLES - 1} done, 1 to redo" in proc.stdout
    same_as_reference("hidden_states")(ws, proc)


def complete_data_files(folder: str) -> Callable[[Workspace, subprocess.CompletedProcess], None]:
    """Every data file under a final name is complete (it loads and matches its prepared row)."""
    def check(ws: Workspace, _proc: subprocess.CompletedProcess) -> None:
        from datasets import load_from_disk

        ids = load_from_disk(str(ws.run / "prepared"))["input_ids"]
        hidden_size = DataConfig.load(ws.reference / "hidden_states").hidden_size
        files = list_sample_files(ws.run / folder)
        assert 0 < len(files) < SAMPLES, "the run was not interrupted in the middle"
        for i, path in files.items():
            assert is_valid_sample(path, ids[i], hidden_size), path
    return check


def resumed_from_checkpoint_0(ws: Workspace, proc: subprocess.CompletedProcess) -> None:
    assert f"resuming after checkpoint {ws.run / 'checkpoints' / '0'}" in proc.stdout
    assert "epoch 1/" not in proc.stdout  # the first epoch was not trained again
    assert sorted(p.name for p in (ws.run / "checkpoints").iterdir()) == ["0", "1"]
    assert (ws.run / "draft" / "model.safetensors").is_file()
    assert json.loads((ws.run / "train_report.json").read_text())["epochs_run"] == [1]


def complete_checkpoints(ws: Workspace, _proc: subprocess.CompletedProcess) -> None:
    for folder in (ws.run / "checkpoints").glob("[0-9]*"):
        assert {"model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt"} <= {
            p.name for p in folder.iterdir()}, folder
    assert not (ws.run / "draft").exists()


def prepare_report(folder: str) -> Callable[[Workspace], dict]:
    return lambda ws: json.loads((ws.run / folder / "prepare_report.json").read_text())


def kept_conversations(read: int, dropped: dict[str, int]) -> Callable[[Workspace, subprocess.CompletedProcess], None]:
    def check(ws: Workspace, _proc: subprocess.CompletedProcess) -> None:
        report = prepare_report("new_prepared")(ws)
        assert (report["samples_read"], report["dropped"]) == (read, dropped)
        assert report["samples_kept"] == read - sum(dropped.values())
    return check


def same_files_kept(ws: Workspace, proc: subprocess.CompletedProcess) -> None:
    assert f"{SAMPLES:,} done, 0 to redo" in proc.stdout
    same_as_reference("hidden_states")(ws, proc)


def reported_skipped(count: int) -> Callable[[Workspace, subprocess.CompletedProcess], None]:
    """04 trained to the end and its report lists the skipped files."""
    def check(ws: Workspace, proc: subprocess.CompletedProcess) -> None:
        report = json.loads((ws.run / "train_report.json").read_text())
        assert len(report["skipped_files"]) == count and report["epochs_run"] == list(range(EPOCHS))
        assert f"skipped {count} of {SAMPLES} hidden-state files" in proc.stdout
        assert (ws.run / "draft" / "model.safetensors").is_file()
    return check


def fresh_run_beside_earlier(ws: Workspace, proc: subprocess.CompletedProcess) -> None:
    earlier = list(ws.run.glob("train.previous-*"))
    assert len(earlier) == 1 and f"were moved to {earlier[0]}" in proc.stdout
    assert {p.name for p in earlier[0].iterdir()} == {"checkpoints", "draft", "train_log.jsonl", "train_log.png",
                                                       "train_report.json", "tensorboard"}
    assert (earlier[0] / "tensorboard" / "train").is_dir()  # the earlier run's curves, moved with it
    new_log = [json.loads(line) for line in (ws.run / "train_log.jsonl").read_text().splitlines()]
    assert new_log[0]["step"] == 0 and {r["epoch"] for r in new_log} == set(range(EPOCHS))


def held_out_found(ws: Workspace, proc: subprocess.CompletedProcess) -> None:
    assert "held-out: 04's validation rows" in proc.stdout, proc.stdout


def evaluated_without(count: int) -> Callable[[Workspace, subprocess.CompletedProcess], None]:
    def check(ws: Workspace, proc: subprocess.CompletedProcess) -> None:
        figures = json.loads((ws.root / "eval.json").read_text())["drafts"][0]
        assert len(figures["offline_skipped_files"]) == count
        assert figures["simulated_acceptance_length"] >= 1.0
    return check


TRAIN_OUTPUTS = ("checkpoints/*", "draft/*", "train_log.jsonl", "train_log.png", "train_report.json")

FAULTS = [
    # 01: the conversations
    Fault("malformed_json_file", PREPARE, lambda ws: conversations_file(ws, "chats.json", '[{"messages": ['),
          1, r"chats\.json: not a valid JSON file", own_process=True),
    Fault("empty_jsonl_file", PREPARE, lambda ws: conversations_file(ws, "empty.jsonl", ""),
          1, r"empty\.jsonl: no usable conversation in 0 read"),
    Fault("unknown_file_format", PREPARE, lambda ws: conversations_file(ws, "chats.csv", "role,content\n"),
          1, r"input .*chats\.csv: unknown format '\.csv'"),
    Fault("unknown_record_format", PREPARE,
          lambda ws: conversations_file(ws, "alpaca.jsonl", '{"instruction": "Hi", "output": "Hello"}\n' * 3),
          1, r"alpaca\.jsonl: no usable conversation in 3 read; dropped: malformed_record 3 .*"
             r"no 'messages' or 'conversations' list"),
    Fault("sigint_01", PREPARE, large_input, 130, INTERRUPTED, interrupt=Interrupt(signal.SIGINT, has_resume_folder)),
    Fault("sigterm_01", PREPARE, large_input, 143, TERMINATED, interrupt=Interrupt(signal.SIGTERM, has_resume_folder)),
    Fault("record_not_utf8", PREPARE,
          lambda ws: conversations_bytes(ws, "bad_bytes.jsonl", b"".join(DEMO_LINES[:2]) + b'{"messages": "\xff"}\n'
                                         + b"".join(DEMO_LINES[2:])),
          0, r"skipped 1 sample\(s\): undecodable_text, e\.g\. .*bad_bytes\.jsonl:3: not UTF-8 text \(byte 0xff",
          may_add=("new_prepared/*",), check=kept_conversations(7, {"undecodable_text": 1})),
    Fault("record_with_lone_surrogate", PREPARE,
          lambda ws: conversations_bytes(ws, "surrogate.jsonl", DEMO_LINES[0] + b'{"messages": [{"role": "user", '
                                         b'"content": "hi \\ud83d"}, {"role": "assistant", "content": "ok"}]}\n'
                                         + b"".join(DEMO_LINES[1:])),
          0, r"undecodable_text, e\.g\. .*surrogate\.jsonl:2: a string holds a lone surrogate \\ud83d",
          may_add=("new_prepared/*",), check=kept_conversations(7, {"undecodable_text": 1})),
    Fault("byte_order_mark", PREPARE,
          lambda ws: conversations_bytes(ws, "bom.jsonl", b"\xef\xbb\xbf" + b"".join(DEMO_LINES)),
          0, None, may_add=("new_prepared/*",), check=kept_conversations(6, {})),
    Fault("tool_result_of_skipped_call", PREPARE,
          lambda ws: conversations_bytes(ws, "tools.jsonl", json.dumps({"messages": [
              {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c1", "function": {"name": "weather", "arguments": "{not json"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
              {"role": "assistant", "content": "It is sunny."}]}).encode() + b"\n" + b"".join(DEMO_LINES)),
          0, r"skipped 1 malformed tool call\(s\): result_of_skipped_call, e\.g\. in .*tools\.jsonl:1",
          may_add=("new_prepared/*",), check=kept_conversations(7, {})),
    Fault("config_json_in_input_folder", PREPARE, input_folder_with_config, 0, None, may_add=("new_prepared/*",),
          check=kept_conversations(6, {})),
    Fault("disk_full_01", PREPARE, lambda ws: ws.prepare("--input", REPO_ROOT / "data" / "demo_conversations.jsonl",
                                                         "--output", mounted_tmpfs(ws, "64k") / "prepared"),
          1, r"cannot write .*mnt/\.tmp-prepared\.resume/\w+: no space left on its disk \([\d.,]+ [KM]?B free\)"),
    Fault("file_size_limit_01", PREPARE,
          lambda ws: ws.prepare("--input", REPO_ROOT / "data" / "demo_conversations.jsonl", "--output",
                                ws.run / "new_prepared"),
          1, r"cannot write .*\.tmp-new_prepared\.resume/\w+: file too large for the file-size limit",
          file_size_limit=64_000),
    # 02: the target, the prepared data, the output folder
    Fault("target_without_weights", EXTRACT, target_without_weights,
          1, r"target .*no_weights: no weights \(model\.safetensors\.index\.json or model\.safetensors not found\)",
          own_process=True),
    Fault("target_not_causal_lm", EXTRACT, target_not_causal_lm,
          1, r"target .*vit: config \(vit\) is not a causal language model: no vocab_size"),
    Fault("prepared_with_other_tokenizer", EXTRACT, lambda ws: ws.extract("new_hidden_states", target=ws.flat),
          1, r"prepared sample \S+ \(row \d+\) holds token id \d+, outside the target's vocabulary 0\.\.4095"),
    Fault("layer_ids_out_of_range", EXTRACT, lambda ws: ws.extract("new_hidden_states", "--layer-ids", 2, 4, 9),
          1, r"--layer-ids 2 4 9: \[9\] out of range"),
    Fault("output_of_other_target", EXTRACT, output_of_other_target,
          1, r"output folder .*hidden_states holds hidden states of another target .*architecture "
             r"KimiK25ForConditionalGeneration in data_config\.json, LlamaForCausalLM now"),
    Fault("torn_prepare_report", EXTRACT,
          torn_json("prepared/prepare_report.json", lambda ws: ws.extract("new_hidden_states")),
          1, r"prepared/prepare_report\.json: not valid JSON"),
    Fault("truncated_data_file_redone", EXTRACT, truncated_then_extract, 0, None,
          may_change=("hidden_states/00000/data_5.pt", "hidden_states/*.json", "hidden_states/extract_journal_*"),
          check=redone_one_file),
    Fault("sigkill_02_then_restart", EXTRACT, lambda ws: ws.extract("new_hidden_states"), 0, None,
          may_change=("new_hidden_states/*.json", "new_hidden_states/extract_journal_*"),
          may_add=("new_hidden_states/*",),
          interrupt=Interrupt(signal.SIGKILL, has_data_files("new_hidden_states")),
          check=same_as_reference("new_hidden_states")),
    Fault("sigint_02", EXTRACT, lambda ws: ws.extract("new_hidden_states"), 130, INTERRUPTED,
          may_add=("new_hidden_states/*",), interrupt=Interrupt(signal.SIGINT, has_data_files("new_hidden_states")),
          check=complete_data_files("new_hidden_states")),
    Fault("sigterm_02", EXTRACT, lambda ws: ws.extract("new_hidden_states"), 143, TERMINATED,
          may_add=("new_hidden_states/*",), interrupt=Interrupt(signal.SIGTERM, has_data_files("new_hidden_states")),
          check=complete_data_files("new_hidden_states")),
    Fault("disk_check_fails", EXTRACT, small_disk,
          1, r"output disk of .*mnt/hidden_states has [\d.,]+ [KMG]?B free, the samples still to extract need about "
             r"[\d.,]+ [KMG]?B; .*--skip-disk-check"),
    Fault("disk_full_while_writing", EXTRACT, full_disk,
          1, r"cannot write .*mnt/hidden_states/00000/data_\d+\.pt \(.*\); [\d.,]+ [KMG]?B free on its disk",
          may_add=("mnt/hidden_states/*",), check=complete_data_files("mnt/hidden_states")),
    Fault("read_only_output_folder", EXTRACT, read_only_output, 1, r"\[Errno \d+\] .*: '.*/read_only/"),
    Fault("data_file_damaged_in_place_verify", EXTRACT, damaged_then_verify, 0, None,
          may_change=("hidden_states/00000/data_5.pt", "hidden_states/*.json", "hidden_states/extract_journal_*"),
          check=redone_one_file),
    Fault("journal_not_utf8", EXTRACT, garbled_journal, 0, None,
          may_change=("hidden_states/*.json", "hidden_states/extract_journal_*"), check=same_files_kept),
    Fault("target_moved_elsewhere", EXTRACT,
          lambda ws: ws.extract("new_hidden_states", target=shutil.copytree(ws.kimi, ws.root / "moved_target")),
          0, None, may_add=("new_hidden_states/*",), check=same_as_reference("new_hidden_states")),
    Fault("target_index_cut_short", EXTRACT, target_with_torn_index,
          1, r"torn_index/model\.safetensors\.index\.json: not valid JSON"),
    Fault("file_size_limit_02", EXTRACT, lambda ws: ws.extract("new_hidden_states"),
          1, r"cannot write .*new_hidden_states/00000/data_\d+\.pt \(.*\); this process may write files of at most "
             r"[\d.]+ KB \(ulimit -f\)", may_add=("new_hidden_states/*",), file_size_limit=20_000),
    Fault("second_02_while_first_runs", EXTRACT, second_extract_while_first_runs,
          1, r"output folder .*new_hidden_states: 02_extract_hidden_states\.py \(pid \d+ on .*\) is writing shard 0 "
             "of 1 into it", own_process=True),
    # 03
    Fault("prepared_arrow_cut_short", VOCAB, truncated_arrow,
          1, r"prepared dataset .*prepared: data-00000-of-00001\.arrow cannot be read \(.*\); run 01_prepare_data\.py "
             "again"),
    Fault("vocab_for_other_target", VOCAB, lambda ws: ["--run-dir", ws.run, "--target", ws.flat, "--output",
                                                       ws.run / "new_vocab"],
          1, r"prepared dataset .*prepared was made for a vocabulary of 163840", own_process=True),
    # 04: the hidden states, the maps, the draft config, interruptions
    Fault("truncated_data_file_train", TRAIN, truncated_then_train,
          0, r"skipped .*hidden_states/00000/data_\d+\.pt: cut short \(100 bytes", may_add=TRAIN_OUTPUTS,
          check=reported_skipped(1)),
    Fault("data_file_damaged_in_place_train", TRAIN, damaged_then_train(damage_in_place),
          0, r"skipped .*hidden_states/00000/data_\d+\.pt: cannot be loaded \(RuntimeError", may_add=TRAIN_OUTPUTS,
          check=reported_skipped(1)),
    Fault("data_file_with_nan", TRAIN, damaged_then_train(nan_in_states),
          0, r"skipped .*hidden_states/00000/data_\d+\.pt: hidden_states holds values that are not finite",
          may_add=TRAIN_OUTPUTS, check=reported_skipped(1)),
    Fault("too_many_damaged_data_files", TRAIN, many_truncated_then_train,
          1, r"11 of 24 hidden-state files could not be used \(more than the limit of 10\), the last .*data_\d+\.pt: "
             r"cut short .*02_extract_hidden_states\.py --verify"),
    Fault("torn_sample_lengths", TRAIN, torn_json("hidden_states/sample_lengths.json", Workspace.train),
          1, r"hidden_states/sample_lengths\.json: not valid JSON"),
    Fault("torn_vocab_report", TRAIN, torn_json("vocab/vocab_report.json", Workspace.train),
          1, r"vocab/vocab_report\.json: not valid JSON"),
    Fault("t2d_cut_short", TRAIN, lambda ws: truncate(ws.run / "vocab" / "t2d.pt") or ws.train(),
          1, r"vocabulary .*vocab/t2d\.pt cannot be read \(\w+\); run 03_build_vocab_map\.py again"),
    Fault("stray_pt_in_data_folder", TRAIN, stray_pt,
          1, r"hidden_states/00000/t2d\.pt is not a hidden-state file"),
    Fault("t2d_of_wrong_length", TRAIN, short_t2d,
          1, r"vocabulary .*vocab: t2d covers 5000 ids, the target has 163840"),
    Fault("draft_hidden_size_differs_from_data", TRAIN, data_of_other_hidden_size,
          1, r"hidden states .*hidden_states_32 have hidden size 32 \(data_config\.json\), but draft config "
             r".*draft_tiny\.json has hidden_size 64"),
    Fault("torn_data_config", TRAIN, torn_json("hidden_states/data_config.json", Workspace.train),
          1, r"hidden_states/data_config\.json: not valid JSON", own_process=True),
    Fault("sigkill_04_then_resume", TRAIN, lambda ws: ws.train(), 0, None,
          may_change=("train_log.jsonl", "train_log.png"), may_add=TRAIN_OUTPUTS,
          interrupt=Interrupt(signal.SIGKILL, has_checkpoint_0, restart=("--resume",)),
          check=resumed_from_checkpoint_0),
    Fault("sigint_04", TRAIN, lambda ws: ws.train(), 130, INTERRUPTED,
          may_add=("checkpoints/*", "train_log.jsonl", "train_log.png"),
          interrupt=Interrupt(signal.SIGINT, has_trained_a_step), check=complete_checkpoints),
    Fault("sigterm_04", TRAIN, lambda ws: ws.train(), 143, TERMINATED,
          may_add=("checkpoints/*", "train_log.jsonl", "train_log.png"),
          interrupt=Interrupt(signal.SIGTERM, has_trained_a_step), check=complete_checkpoints),
    # 04 on a trained run: flags on --resume, a damaged checkpoint, a fresh run beside an earlier one
    Fault("resume_with_other_lr", TRAIN, resume_with("--lr", 0.5),
          1, r"--lr 0\.5: checkpoint .*checkpoints/0 was trained with lr "
             + re.escape(str(json.loads(TINY_CONFIG.read_text())["training"]["lr"])) + ", which a resumed run keeps",
          trained=True),
    Fault("resume_with_other_scheduler", TRAIN, resume_with("--scheduler", "cosine"),
          1, r"--scheduler cosine: checkpoint .*checkpoints/0 was trained with scheduler linear", trained=True),
    Fault("resume_with_other_noise_std", TRAIN, resume_with("--noise-std", 0.2),
          1, r"--noise-std 0\.2: checkpoint .*checkpoints/0 was trained with noise_std 0\.05", trained=True),
    Fault("resume_with_other_total_seq_len", TRAIN, resume_with("--total-seq-len", 256),
          1, rf"--total-seq-len 256: checkpoint .*checkpoints/0 was trained with total_seq_len {SEQ}", trained=True),
    Fault("checkpoint_cut_short", TRAIN, truncated_checkpoint,
          1, r"checkpoint .*checkpoints/0: optimizer_state_dict\.pt cannot be read \(.*\); move that folder aside",
          trained=True),
    Fault("torn_trainer_state", TRAIN, torn_json("checkpoints/0/trainer_state.json", resume_with()),
          1, r"checkpoints/0/trainer_state\.json: not valid JSON", trained=True),
    Fault("fresh_run_beside_an_earlier_one", TRAIN, lambda ws: ws.train(), 0, None,
          may_add=(*TRAIN_OUTPUTS, "train.previous-*"), moved_to="train.previous-*", trained=True,
          check=fresh_run_beside_earlier),
    # 05: the draft
    Fault("draft_for_other_target", EVALUATE, draft_of_flat_target,
          1, r"draft .*draft maps a target vocabulary of 4,096 ids, but target .*kimi has 163,840"),
    Fault("draft_weights_cut_short", EVALUATE, draft_weights_cut_short,
          1, r"draft/model\.safetensors: not a readable safetensors file", own_process=True),
    Fault("prepared_of_another_run", EVALUATE, prepared_again,
          1, r"prepared dataset .*prepared is not the one draft .*draft was trained on \(prepared fingerprint \w+, "
             r".*validation_split\.json records \w+\)", may_change=("prepared/*",), trained=True),
    Fault("run_folder_copied", EVALUATE, copied_run_folder, 0, None, trained=True, check=held_out_found),
    Fault("held_out_data_file_damaged", EVALUATE, damaged_held_out_file,
          0, r"skipped .*hidden_states/00000/data_\d+\.pt: cannot be loaded", trained=True, check=evaluated_without(1)),
    Fault("torn_validation_split", EVALUATE, torn_json("draft/validation_split.json", Workspace.evaluate),
          1, r"draft/validation_split\.json: not valid JSON", trained=True),
]


# --- running a case ---------------------------------------------------------------------------


def interrupted_run(fault: Fault, ws: Workspace, args: list) -> subprocess.CompletedProcess:
    """Start the script, send the signal once the case is ready, and wait for the end. Output
    goes to files: a pipe nobody reads while polling could fill up and stall the script."""
    out, err = ws.root / "stdout.txt", ws.root / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(REPO_ROOT / fault.script), *map(str, args)], cwd=REPO_ROOT,
                                stdout=stdout, stderr=stderr, env={**os.environ, **ENV})
        deadline = time.monotonic() + TIMEOUT
        try:
            while not fault.interrupt.ready(ws.run):
                assert proc.poll() is None, f"{fault.script} ended before it was interrupted:\n{err.read_text()}"
                assert time.monotonic() < deadline, f"{fault.script}: not ready to interrupt after {TIMEOUT}s"
                time.sleep(0.02)
            proc.send_signal(fault.interrupt.signal)
            proc.wait(timeout=TIMEOUT)
        finally:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


def limited_run(fault: Fault, args: list) -> subprocess.CompletedProcess:
    """The script with a file-size limit (`ulimit -f`): a write past it fails with EFBIG (Python
    ignores the SIGXFSZ that would otherwise kill the process)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fault.file_size_limit, fault.file_size_limit))
    return subprocess.run([sys.executable, str(REPO_ROOT / fault.script), *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **ENV},
                          preexec_fn=limit)


def run_case(fault: Fault, ws: Workspace) -> None:
    """Set the fault up, run the script, and check the status, the message and the files."""
    shutil.copytree(ws.reference, ws.run)
    try:
        args = fault.setup(ws)
        before = folder_digest(ws.run)
        interrupt = fault.interrupt
        if interrupt is not None:
            proc = interrupted_run(fault, ws, args)
        elif fault.file_size_limit is not None:
            proc = limited_run(fault, args)
        elif fault.in_process:
            proc = run_in_process(fault.script, *args)
        else:
            proc = run_script(fault.script, *args, check=False, timeout=TIMEOUT, env=ENV)
        if interrupt is not None and interrupt.signal == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL, proc.stderr
            before = folder_digest(ws.run)  # what the killed run wrote must survive the restart as well
            proc = run_script(fault.script, *args, *interrupt.restart, check=False, timeout=TIMEOUT, env=ENV)
        after = folder_digest(ws.run)
        check_outcome(fault, ws, proc, before, after)
    finally:
        restore_environment(ws)


def moved_unchanged(rel: str, digest: str, after: dict, moved_to: str | None) -> bool:
    """Whether a file that left `rel` is now under `moved_to` (a glob) with the same content."""
    return moved_to is not None and any(fnmatch.fnmatch(p, f"{moved_to}/{rel}") and h == digest
                                        for p, h in after.items())


def check_outcome(fault: Fault, ws: Workspace, proc: subprocess.CompletedProcess, before: dict, after: dict) -> None:
    output = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == fault.status, output
    assert "Traceback" not in proc.stderr, output
    if fault.stderr is not None and fault.status == 0:  # the run went on: a warning names what it skipped
        assert any(re.search(r"^warning: .*" + fault.stderr, line) for line in proc.stderr.splitlines()), output
    elif fault.stderr is not None:
        last = proc.stderr.strip().splitlines()[-1]
        pattern = fault.stderr if fault.status in (130, 143) else r"^error: .*" + fault.stderr
        assert re.search(pattern, last), f"last stderr line: {last!r}\n{output}"
    kept = {p: h for p, h in before.items() if not is_temporary(p)}  # a rerun may clean temporaries up
    lost = sorted(p for p in set(kept) - set(after) if not moved_unchanged(p, kept[p], after, fault.moved_to))
    changed = sorted(p for p in kept if p in after and kept[p] != after[p] and not matches(p, fault.may_change)
                     and not moved_unchanged(p, kept[p], after, fault.moved_to))
    added = sorted(p for p in set(after) - set(before)
                   if not is_temporary(p) and not matches(p, fault.may_add + TRACKER_OUTPUTS))
    assert not lost, f"files lost: {lost}"
    assert not changed, f"files changed: {changed}"
    assert not added, f"files written under a final name: {added}"
    if fault.interrupt is not None and fault.interrupt.signal == signal.SIGKILL:
        assert not [p for p in after if is_temporary(p)], "the restart left temporaries behind"
    if fault.check is not None:
        fault.check(ws, proc)


@pytest.fixture(scope="session")
def outcomes(request, tmp_path_factory, shared_run, kimi_target, flat_target) -> Iterator[dict[str, Callable]]:
    """Start every selected case that runs its script as a subprocess, JOBS at a time (a case is a
    few script runs, mostly start-up); each case's test waits for its own outcome, or runs its case
    itself when the script runs in process (in the test's thread: it redirects stdout and stderr)."""
    selected = [item.callspec.params["fault"] for item in request.session.items
                if getattr(item, "function", None) is test_fault]
    root = tmp_path_factory.mktemp("fault-cases")
    trained = request.getfixturevalue("trained_run") if any(f.trained for f in selected) else None

    def execute(fault: Fault) -> None:
        base = trained if fault.trained else shared_run
        ws = Workspace(root / fault.name, root / fault.name / "run", base, kimi_target, flat_target)
        ws.root.mkdir()
        run_case(fault, ws)

    pool = ThreadPoolExecutor(JOBS)
    started = {fault.name: pool.submit(execute, fault).result for fault in selected if not fault.in_process}
    yield {**started, **{fault.name: partial(execute, fault) for fault in selected if fault.in_process}}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault(fault, outcomes):
    outcomes[fault.name]()  # the case's own failure (or skip), raised here


def test_catalog_covers_at_least_fifty_faults():
    assert len({f.name for f in FAULTS}) == len(FAULTS) >= 50
