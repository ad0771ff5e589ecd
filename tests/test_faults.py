"""Fault drills: the numbered scripts run as real subprocesses against broken input, a broken
environment and interruptions, one catalog entry per fault.

Every case checks three things: the exit status (or, for a kill drill, that the restart
succeeds), one line on stderr naming the cause (the file, flag or sample; no traceback), and
that nothing already written was lost or corrupted: the case's whole run folder is hashed
before and after, every file present before must be unchanged (except those the case names
as rewritten), and a new file may appear only where the case allows it or under a temporary
`.tmp-*` name.

The shared inputs (01 -> 02 -> 03 on a few demo conversations, Kimi-style miniature target)
are made once per session; each case works on its own copy. The cases run in a pool of
FAULT_JOBS worker threads (default: the usable cores, at least 2), each case a few script runs;
the test of a case reports its outcome.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import export_untrained, run_script
from test_02_extract import BATCH_TOKENS, assert_same_files, extract_args, folder_digest, write_prepared
from test_04_train import write_hidden_states

from common.atomic import TMP_PREFIX
from common.defaults import REPO_ROOT
from common.draft.model import TINY_CONFIG
from common.hidden_states.files import SAMPLE_LENGTHS, DataConfig, is_valid_sample, list_sample_files, sample_path

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
def shared_run(tmp_path_factory, kimi_target, demo_conversations) -> Path:
    """01 -> 02 -> 03 on a few demo conversations; 02 with the batch budget every 02 case uses,
    so a resumed run can be compared with it file for file."""
    run = tmp_path_factory.mktemp("faults") / "run"
    common = ["--run-dir", run, "--target", kimi_target, "--trust-remote-code"]
    run_script(PREPARE, *common, "--input", demo_conversations, "--max-samples", SAMPLES, "--max-len", MAX_LEN,
               env=ENV)
    run_script(EXTRACT, *common, "--batch-tokens", BATCH_TOKENS, env=ENV)
    run_script(VOCAB, *common, "--draft-vocab-size", DRAFT_VOCAB, env=ENV)
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


def is_temporary(rel: str) -> bool:
    return any(part.startswith(TMP_PREFIX) for part in Path(rel).parts)


def matches(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


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
    """Undo `read_only_output` and `mounted_tmpfs` so the folder can be checked and removed."""
    folder, mount = ws.run / "read_only", ws.run / "mnt"
    if folder.is_dir() and os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=False)
    elif folder.is_dir():
        folder.chmod(0o755)
    if os.path.ismount(mount):
        subprocess.run(["umount", str(mount)], check=False)


# ready conditions of the interrupt drills


def has_data_files(folder: str) -> Callable[[Path], bool]:
    return lambda run: any((run / folder).rglob("data_*.pt"))


def has_scratch(run: Path) -> bool:
    return any(run.glob(f"{TMP_PREFIX}new_prepared.scratch.*"))


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


TRAIN_OUTPUTS = ("checkpoints/*", "draft/*", "train_log.jsonl", "train_log.png", "train_report.json")

FAULTS = [
    # 01: the conversations
    Fault("malformed_json_file", PREPARE, lambda ws: conversations_file(ws, "chats.json", '[{"messages": ['),
          1, r"chats\.json: not a valid JSON file"),
    Fault("empty_jsonl_file", PREPARE, lambda ws: conversations_file(ws, "empty.jsonl", ""),
          1, r"empty\.jsonl: no usable conversation in 0 read"),
    Fault("unknown_file_format", PREPARE, lambda ws: conversations_file(ws, "chats.csv", "role,content\n"),
          1, r"input .*chats\.csv: unknown format '\.csv'"),
    Fault("unknown_record_format", PREPARE,
          lambda ws: conversations_file(ws, "alpaca.jsonl", '{"instruction": "Hi", "output": "Hello"}\n' * 3),
          1, r"alpaca\.jsonl: no usable conversation in 3 read; dropped: malformed_record 3 .*"
             r"no 'messages' or 'conversations' list"),
    Fault("sigint_01", PREPARE, large_input, 130, INTERRUPTED, interrupt=Interrupt(signal.SIGINT, has_scratch)),
    # 02: the target, the prepared data, the output folder
    Fault("target_without_weights", EXTRACT, target_without_weights,
          1, r"target .*no_weights: no weights \(model\.safetensors\.index\.json or model\.safetensors not found\)"),
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
          1, r"output disk of .*mnt/hidden_states has .* free, the samples still to extract need .*--skip-disk-check"),
    Fault("disk_full_while_writing", EXTRACT, full_disk,
          1, r"cannot write .*mnt/hidden_states/00000/data_\d+\.pt \(.*\); [\d.]+ MB free on its disk",
          may_add=("mnt/hidden_states/*",), check=complete_data_files("mnt/hidden_states")),
    Fault("read_only_output_folder", EXTRACT, read_only_output, 1, r"\[Errno \d+\] .*: '.*/read_only/"),
    # 03
    Fault("vocab_for_other_target", VOCAB, lambda ws: ["--run-dir", ws.run, "--target", ws.flat, "--output",
                                                       ws.run / "new_vocab"],
          1, r"prepared dataset .*prepared was made for a vocabulary of 163840"),
    # 04: the hidden states, the maps, the draft config, interruptions
    Fault("truncated_data_file_train", TRAIN, truncated_then_train,
          1, r"hidden_states/00000/data_\d+\.pt is cut short \(1 such files\); run 02_extract_hidden_states\.py again"),
    Fault("stray_pt_in_data_folder", TRAIN, stray_pt,
          1, r"hidden_states/00000/t2d\.pt is not a hidden-state file"),
    Fault("t2d_of_wrong_length", TRAIN, short_t2d,
          1, r"vocabulary .*vocab: t2d covers 5000 ids, the target has 163840"),
    Fault("draft_hidden_size_differs_from_data", TRAIN, data_of_other_hidden_size,
          1, r"hidden states .*hidden_states_32 have hidden size 32 \(data_config\.json\), but draft config "
             r".*draft_tiny\.json has hidden_size 64"),
    Fault("torn_data_config", TRAIN, torn_json("hidden_states/data_config.json", Workspace.train),
          1, r"hidden_states/data_config\.json: not valid JSON"),
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
    # 05: the draft
    Fault("draft_for_other_target", EVALUATE, draft_of_flat_target,
          1, r"draft .*draft maps a target vocabulary of 4,096 ids, but target .*kimi has 163,840"),
    Fault("draft_weights_cut_short", EVALUATE, draft_weights_cut_short,
          1, r"draft/model\.safetensors: not a readable safetensors file"),
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


def run_case(fault: Fault, ws: Workspace) -> None:
    """Set the fault up, run the script, and check the status, the message and the files."""
    shutil.copytree(ws.reference, ws.run)
    try:
        args = fault.setup(ws)
        before = folder_digest(ws.run)
        interrupt = fault.interrupt
        proc = (run_script(fault.script, *args, check=False, timeout=TIMEOUT, env=ENV) if interrupt is None
                else interrupted_run(fault, ws, args))
        if interrupt is not None and interrupt.signal == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL, proc.stderr
            before = folder_digest(ws.run)  # what the killed run wrote must survive the restart as well
            proc = run_script(fault.script, *args, *interrupt.restart, check=False, timeout=TIMEOUT, env=ENV)
        after = folder_digest(ws.run)
        check_outcome(fault, ws, proc, before, after)
    finally:
        restore_environment(ws)


def check_outcome(fault: Fault, ws: Workspace, proc: subprocess.CompletedProcess, before: dict, after: dict) -> None:
    output = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == fault.status, output
    assert "Traceback" not in proc.stderr, output
    if fault.stderr is not None:
        last = proc.stderr.strip().splitlines()[-1]
        pattern = fault.stderr if fault.status in (130, 143) else r"^error: .*" + fault.stderr
        assert re.search(pattern, last), f"last stderr line: {last!r}\n{output}"
    kept = {p: h for p, h in before.items() if not is_temporary(p)}  # a rerun may clean temporaries up
    lost = sorted(set(kept) - set(after))
    changed = sorted(p for p in kept if p in after and kept[p] != after[p] and not matches(p, fault.may_change))
    added = sorted(p for p in set(after) - set(before) if not is_temporary(p) and not matches(p, fault.may_add))
    assert not lost, f"files lost: {lost}"
    assert not changed, f"files changed: {changed}"
    assert not added, f"files written under a final name: {added}"
    if fault.interrupt is not None and fault.interrupt.signal == signal.SIGKILL:
        assert not [p for p in after if is_temporary(p)], "the restart left temporaries behind"
    if fault.check is not None:
        fault.check(ws, proc)


@pytest.fixture(scope="session")
def outcomes(request, tmp_path_factory, shared_run, kimi_target, flat_target) -> Iterator[dict[str, Future]]:
    """Start every selected case, JOBS at a time (a case is a few script runs, mostly start-up);
    each case's test waits for its own."""
    selected = [item.callspec.params["fault"] for item in request.session.items
                if getattr(item, "function", None) is test_fault]
    root = tmp_path_factory.mktemp("fault-cases")

    def execute(fault: Fault) -> None:
        ws = Workspace(root / fault.name, root / fault.name / "run", shared_run, kimi_target, flat_target)
        ws.root.mkdir()
        run_case(fault, ws)

    pool = ThreadPoolExecutor(JOBS)
    yield {fault.name: pool.submit(execute, fault) for fault in selected}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault(fault, outcomes):
    outcomes[fault.name].result()  # the case's own failure (or skip), raised here


def test_catalog_covers_at_least_twenty_faults():
    assert len({f.name for f in FAULTS}) == len(FAULTS) >= 20
