"""Step 04: settings and config files, the hidden-state checks, training through the library's
Trainer, the exported draft and its loader, resuming after SIGKILL, the quality bar and bad input.

The end-to-end tests share one pipeline run on the Kimi-style miniature target: 01 -> 02 -> 03,
then 04 killed after its first epoch and resumed (real subprocesses)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from helpers import (
    ONE_THREAD,
    kill_after_step_checkpoint,
    run_in_process,
    run_script,
    tensorboard_scalars,
    write_hidden_states,
    write_vocab_folder,
)
from safetensors import safe_open
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from common.defaults import REPO_ROOT
from common.draft import forward as draft_forward
from common.draft import patch
from common.draft.model import (
    KIMI_CONFIG,
    NOT_EXPORTED,
    TINY_CONFIG,
    build_draft,
    load_draft,
    read_config_file,
    read_saved_config,
)
from common.draft.validation import simulated_acceptance_length, validation_metrics
from common.errors import PipelineError
from common.hidden_states.loader import load_hidden_states, make_loader, split_data
from common.hidden_states.storage import STORAGES
from common.target.config import load_target_info
from common.train import checkpoints
from common.train.metrics import read_log
from common.train.settings import TrainSettings
from common.vocab import load_vocab

SCRIPT = "04_train.py"
SEQ = 512  # --total-seq-len of the test runs: short sequences, many optimizer steps
DRAFT_VOCAB = 1024
LOG = "train_log.jsonl"
EPOCHS = 2


def load_script():
    spec = importlib.util.spec_from_file_location("train_04", REPO_ROOT / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_in_process(*args: str | Path) -> None:
    """04's `main` in this process: user errors surface as PipelineError, not as an exit."""
    load_script().main([str(a) for a in args])


@pytest.fixture(autouse=True)
def patched():
    patch.apply(trust_remote_code=True, compile_forward=False)


# --- the shared pipeline run -----------------------------------------------------------------


@dataclass
class TrainedRun:
    target: Path
    run: Path
    killed_stdout: str  # the first 04 run, killed after its first epoch
    resumed_stdout: str
    checkpoint0_before: str  # sha256 of checkpoint 0's weights when the first run was killed
    epoch0_records_before: int

    def train_args(self, *extra: str | Path) -> list[str | Path]:
        return ["--run-dir", self.run, "--target", self.target, "--trust-remote-code", "--draft-config", TINY_CONFIG,
                "--epochs", str(EPOCHS), "--total-seq-len", str(SEQ), "--noise-std", "0", *extra]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kill_after_first_checkpoint(args: list[str | Path], checkpoint: Path, timeout: float = 600) -> str:
    """Start 04, SIGKILL it as soon as checkpoint 0 is in place, return its output so far."""
    log = checkpoint.parent.parent / "killed_run.out"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO_ROOT / SCRIPT), *map(str, args)], cwd=REPO_ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not checkpoint.is_dir() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"04 ended on its own before it was killed:\n{log.read_text()}"
    return log.read_text()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, kimi_target, demo_conversations) -> TrainedRun:
    run = tmp_path_factory.mktemp("run04")
    common = ["--run-dir", run, "--target", kimi_target, "--trust-remote-code"]
    run_in_process("01_prepare_data.py", *common, "--input", demo_conversations, "--max-samples", "100",
                   "--max-len", str(SEQ), check=True)
    run_in_process("02_extract_hidden_states.py", *common, check=True)
    run_in_process("03_build_vocab_map.py", *common, "--draft-vocab-size", str(DRAFT_VOCAB), check=True)
    partial = TrainedRun(kimi_target, run, "", "", "", 0)
    killed = kill_after_first_checkpoint(partial.train_args(), run / "checkpoints" / "0")
    before = sha256(run / "checkpoints" / "0" / "model.safetensors")
    epoch0 = sum(1 for r in read_log(run / "train_log.jsonl") if r.get("epoch") == 0)
    resumed = run_script(SCRIPT, *partial.train_args("--resume")).stdout
    return replace(partial, killed_stdout=killed, resumed_stdout=resumed, checkpoint0_before=before,
                   epoch0_records_before=epoch0)


@dataclass
class ValData:
    settings: TrainSettings
    loader: torch.utils.data.DataLoader
    train_loader: torch.utils.data.DataLoader


def validation_data(run: TrainedRun) -> ValData:
    """The run's own validation split and loader (same seed, same files)."""
    settings, _ = TrainSettings.resolve(read_config_file(TINY_CONFIG), {"total_seq_len": SEQ, "noise_std": 0.0})
    data = load_hidden_states(run.run / "hidden_states")
    train, val = split_data(data, settings)
    return ValData(settings, make_loader(data, val, settings, 1, 0, train=False, pin_memory=False),
                   make_loader(data, train, settings, 1, 0, train=False, pin_memory=False))


# --- end to end --------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_after_sigkill_continues_from_the_next_epoch(trained):
    assert f"epoch 1/{EPOCHS}:" in trained.killed_stdout
    assert "resuming after checkpoint" in trained.resumed_stdout
    assert "split the data by prepared row" not in trained.resumed_stdout  # its own checkpoint, the same split
    assert f"epoch {EPOCHS}/{EPOCHS}" in trained.resumed_stdout
    assert "epoch 1/" not in trained.resumed_stdout  # epoch 1 was not trained again
    ckpts = trained.run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [str(e) for e in range(EPOCHS)]
    assert sha256(ckpts / "0" / "model.safetensors") == trained.checkpoint0_before
    records = read_log(trained.run / "train_log.jsonl")
    assert sum(1 for r in records if r.get("epoch") == 0) == trained.epoch0_records_before
    assert [r["epoch"] for r in records if "val" in r] == list(range(EPOCHS))
    steps = [r["step"] for r in records if "train" in r]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # one numbering across both runs
    report = json.loads((trained.run / "train_report.json").read_text())
    assert report["epochs_run"] == [EPOCHS - 1]


@pytest.mark.slow
def test_quality_bar_beats_untrained_draft_and_most_frequent_token(trained):
    val = validation_data(trained)
    config = read_saved_config(trained.run / "draft")
    vocab = load_vocab(trained.run / "vocab")
    torch.manual_seed(0)
    untrained = build_draft(config, vocab.t2d, vocab.d2t)
    untrained_acc = validation_metrics(untrained, val.loader, torch.device("cpu"),
                                       val.settings.call_kwargs())["full_acc_0"]
    baseline_acc = most_frequent_token_accuracy(untrained.verifier_lm_head, val.train_loader, val.loader)

    records = read_log(trained.run / "train_log.jsonl")
    vals = [r["val"] for r in records if "val" in r]
    trained_acc = vals[-1]["full_acc_0_epoch"]
    print(f"validation step-0 accuracy: trained {trained_acc:.3f}, untrained {untrained_acc:.3f}, "
          f"most frequent token {baseline_acc:.3f}; "
          f"val loss {vals[0]['loss_epoch']:.3f} -> {vals[-1]['loss_epoch']:.3f}")
    # A clear margin over both (the miniature, like a real LM, often predicts a few frequent tokens,
    # so the most-frequent-token baseline is far from zero).
    assert trained_acc > max(untrained_acc, baseline_acc) + 0.1
    # TTT step 0 reads the same tokens in training and validation, so its loss must fall; later steps
    # train on the data's tokens (teacher forcing) and are validated on the draft's own guesses, as
    # served, so what must rise for them is the acceptance they give, not their loss
    first, last = vals[0], vals[-1]
    print(f"val loss of step 0 {first['loss_0_epoch']:.3f} -> {last['loss_0_epoch']:.3f}, simulated acceptance "
          f"length {simulated_length(first):.3f} -> {simulated_length(last):.3f}")
    assert last["loss_0_epoch"] < first["loss_0_epoch"]
    assert simulated_length(last) > simulated_length(first)
    train_losses = [r["train"]["loss"] for r in records if "train" in r]
    assert sum(train_losses[-5:]) < 0.7 * sum(train_losses[:5])


def simulated_length(val: dict) -> float:
    return simulated_acceptance_length([val[f"cond_acc_{k}_epoch"] for k in range(3)])


@torch.no_grad()
def most_frequent_token_accuracy(verifier_lm_head, train_loader, val_loader) -> float:
    """Step-0 accuracy of always proposing the target's most frequent next token of the training
    split, averaged over validation batches as the Trainer averages its metrics."""
    counts = torch.zeros(verifier_lm_head.weight.shape[0])
    for batch in train_loader:
        top = verifier_lm_head(batch["verifier_last_hidden_states"]).argmax(-1)[batch["loss_mask"].bool()]
        counts += torch.bincount(top, minlength=counts.numel())
    accs = []
    for batch in val_loader:
        top = verifier_lm_head(batch["verifier_last_hidden_states"]).argmax(-1)[batch["loss_mask"].bool()]
        accs.append((top == counts.argmax()).float().mean().item())
    return sum(accs) / len(accs)


@pytest.mark.slow
def test_exported_draft_is_speculators_format(trained):
    draft = trained.run / "draft"
    config = json.loads((draft / "config.json").read_text())
    data_config = json.loads((trained.run / "hidden_states" / "data_config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == data_config["layer_ids"] == [2, 4, 5]
    assert config["dtype"] == "bfloat16"
    layer = config["transformer_layer_config"]
    assert layer["rope_theta"] == 50000.0 and layer["rope_scaling"]["rope_type"] == "yarn"
    assert layer["rope_scaling"]["factor"] == 64.0 and layer["vocab_size"] == 163840
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(trained.target.resolve()),
                        "architectures": ["KimiK25ForConditionalGeneration"]}
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {k: f.get_tensor(k).dtype for k in keys}
        d2t = f.get_tensor("d2t")
    assert "verifier_lm_head.weight" not in keys and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys
    assert dtypes["d2t"] == torch.int64 and dtypes["t2d"] == torch.bool
    assert all(d == torch.bfloat16 for k, d in dtypes.items() if k not in ("d2t", "t2d"))
    assert torch.equal(d2t, load_vocab(trained.run / "vocab").d2t)
    split = json.loads((draft / "validation_split.json").read_text())
    assert len(split["validation_rows"]) == 10 and split["train_samples"] == 90


@pytest.mark.slow
def test_exported_draft_reloads_with_the_same_validation_metrics(trained):
    val = validation_data(trained)
    cpu = torch.device("cpu")
    report = json.loads((trained.run / "train_report.json").read_text())
    best = report["best_validation"]
    draft = load_draft(trained.run / "draft", trust_remote_code=True)
    # the validation loss is the trained one: toward the target at the config's temperature (after
    # load_draft, which installs the patch with its defaults)
    patch.apply(trust_remote_code=True, compile_forward=False, target_temperature=val.settings.target_temperature)
    # The pass of the exported checkpoint's epoch: the packing, and so the mean over batches, follows the epoch.
    reloaded = validation_metrics(draft, val.loader, cpu, val.settings.call_kwargs(), epoch=best["epoch"])

    # the exported checkpoint (the best by validation simulated acceptance length, saved in fp32), built
    # the library's way
    exported = Path(report["exported_checkpoint"])
    assert exported == trained.run / "checkpoints" / str(best["epoch"])
    vals = [r for r in read_log(trained.run / "train_log.jsonl") if "val" in r]
    assert best["acceptance_length"] == pytest.approx(max(simulated_acceptance_length(
        [r["val"][f"cond_acc_{k}_epoch"] for k in range(3)]) for r in vals))
    vocab = load_vocab(trained.run / "vocab")
    model = build_draft(read_saved_config(exported), vocab.t2d, vocab.d2t)
    model.load_state_dict(load_file(str(exported / "model.safetensors")), strict=False)
    for name, tensor in model.state_dict().items():  # the export's one change: bf16
        if tensor.is_floating_point() and name not in NOT_EXPORTED:
            tensor.copy_(tensor.to(torch.bfloat16))
    assert reloaded == validation_metrics(model, val.loader, cpu, val.settings.call_kwargs(), epoch=best["epoch"])

    logged = next(r["val"] for r in vals if r["epoch"] == best["epoch"])
    assert reloaded["loss"] == pytest.approx(logged["loss_epoch"], rel=0.02)  # trained in fp32, exported in bf16
    for k in range(3):  # rounding a width-64 draft to bf16 moves accuracy by a few points (0.514 vs 0.538 seen)
        assert reloaded[f"full_acc_{k}"] == pytest.approx(logged[f"full_acc_{k}_epoch"], abs=0.03)


@pytest.mark.slow
def test_summary_and_report(trained):
    report = json.loads((trained.run / "train_report.json").read_text())
    validation = report["validation"]
    assert validation["acceptance_length"] == pytest.approx(simulated_acceptance_length(validation["cond_acc"]))
    assert len(validation["full_acc"]) == len(validation["cond_acc"]) == 3
    assert "simulated acceptance length" in trained.resumed_stdout
    assert (trained.run / "train_log.png").read_bytes()[:4] == b"\x89PNG"
    assert report["train_samples"] == 90 and report["val_samples"] == 10


# --- training on the flat target, in process ---------------------------------------------------


def test_trains_on_the_flat_target(tmp_path, flat_target, capsys):
    info = load_target_info(flat_target, trust_remote_code=True)
    write_hidden_states(tmp_path / "hs", flat_target, num_samples=12)
    write_vocab_folder(tmp_path / "vocab", info.vocab_size)
    train_in_process("--target", flat_target, "--draft-config", TINY_CONFIG, "--data", tmp_path / "hs",
             "--vocab", tmp_path / "vocab", "--output", tmp_path / "out", "--epochs", "1",
             "--total-seq-len", "128", "--val-ratio", "0.25")
    out = capsys.readouterr().out
    assert "epoch 1/1:" in out and "simulated acceptance length" in out
    assert f"reporting to tensorboard: {tmp_path / 'out' / 'tensorboard' / 'train'}" in out  # the default
    assert "train/loss" in tensorboard_scalars(tmp_path / "out" / "tensorboard" / "train")
    config = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    assert config["transformer_layer_config"]["rope_theta"] == 10000.0  # the flat target's own
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert load_draft(tmp_path / "out" / "draft").lm_head.weight.shape == (200, 64)


def test_activation_checkpointing_trains_the_same_draft(tmp_path, flat_target, monkeypatch):
    """--activation-checkpointing recomputes each TTT step in the backward pass: a 128-token pack is one
    loss tile per step, so on a CPU every step's metrics and the exported draft are the plain run's bits
    (tests/common/draft/test_forward.py)."""
    checkpointed = []  # the regions the checkpointed forward ran under torch's checkpoint
    monkeypatch.setattr(draft_forward, "checkpoint", lambda *a, **k: checkpointed.append(1) or checkpoint(*a, **k))
    write_hidden_states(tmp_path / "hs", flat_target, num_samples=12)
    write_vocab_folder(tmp_path / "vocab", load_target_info(flat_target, trust_remote_code=True).vocab_size)
    runs = {}
    for name, flags in (("plain", []), ("checkpointed", ["--activation-checkpointing"])):
        train_in_process("--target", flat_target, "--draft-config", TINY_CONFIG, "--data", tmp_path / "hs",
                         "--vocab", tmp_path / "vocab", "--output", tmp_path / name, "--epochs", "1",
                         "--total-seq-len", "128", "--val-ratio", "0.25", "--report-to", "none", *flags)
        runs[name] = ([{k: r[k] for k in ("train", "val") if k in r} for r in read_log(tmp_path / name / LOG)],
                      load_file(str(tmp_path / name / "draft" / "model.safetensors")))
    assert checkpointed and any("train" in r for r in runs["plain"][0]) and any("val" in r for r in runs["plain"][0])
    assert runs["checkpointed"][0] == runs["plain"][0]
    assert runs["checkpointed"][1].keys() == runs["plain"][1].keys()
    for name, value in runs["plain"][1].items():
        assert torch.equal(runs["checkpointed"][1][name], value), name


def test_trains_on_fp8_data_through_the_library_loader(tmp_path, kimi_target, capsys):
    """04 on an fp8 folder: the library's dataset hands the Trainer the dequantized states."""
    info = load_target_info(kimi_target, trust_remote_code=True)
    data_dir = write_hidden_states(tmp_path / "hs", kimi_target, num_samples=12, storage="fp8")
    data = load_hidden_states(data_dir)
    settings, _ = TrainSettings.resolve(read_config_file(TINY_CONFIG), {"total_seq_len": 128, "noise_std": 0.0})
    loader = make_loader(data, data.files[:1], settings, 1, 0, train=False, pin_memory=False)
    batch = next(iter(loader))
    stored = torch.load(data.files[0], weights_only=True)
    states = STORAGES["fp8"].decode(stored)
    n = len(stored["input_ids"]) - 1
    assert torch.equal(batch["hidden_states"][0, :n], torch.cat(states[:3], dim=-1)[:-1])
    assert torch.equal(batch["verifier_last_hidden_states"][0, :n], states[3][1:])
    write_vocab_folder(tmp_path / "vocab", info.vocab_size)
    train_in_process("--target", kimi_target, "--trust-remote-code", "--draft-config", TINY_CONFIG,
                     "--data", data_dir, "--vocab", tmp_path / "vocab", "--output", tmp_path / "out",
                     "--epochs", "1", "--total-seq-len", "128", "--val-ratio", "0.25", "--report-to", "none")
    out = capsys.readouterr().out
    assert "simulated acceptance length" in out and "reporting to" not in out
    assert (tmp_path / "out" / "draft" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "tensorboard").exists() and not (tmp_path / "out" / "wandb").exists()


def test_a_tracker_not_installed_is_refused_before_training(tmp_path, flat_target, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where the package is not installed
    write_hidden_states(tmp_path / "hs", flat_target, num_samples=4)
    write_vocab_folder(tmp_path / "vocab", load_target_info(flat_target, trust_remote_code=True).vocab_size)
    result = run_in_process(SCRIPT, "--target", flat_target, "--draft-config", TINY_CONFIG, "--data", tmp_path / "hs",
                            "--vocab", tmp_path / "vocab", "--output", tmp_path / "out", "--report-to", "wandb")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == ("error: --report-to wandb needs the wandb package, which is not "
                                                      "installed: pip install wandb")
    assert not (tmp_path / "out").exists()


# --- resuming mid-epoch equals an uninterrupted run --------------------------------------------


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, flat_target) -> Path:
    """Hidden states and vocabulary of the flat target: 64 training samples, 32 steps per epoch."""
    folder = tmp_path_factory.mktemp("small04")
    write_hidden_states(folder / "hs", flat_target, num_samples=80)
    write_vocab_folder(folder / "vocab", load_target_info(flat_target, trust_remote_code=True).vocab_size)
    return folder


def small_args(data: Path, target: Path, out: str, *extra: str) -> list[str | Path]:
    return ["--target", target, "--draft-config", TINY_CONFIG, "--data", data / "hs", "--vocab", data / "vocab",
            "--output", data / out, "--total-seq-len", "128", "--val-ratio", "0.2", "--noise-std", "0.05",
            "--save-every", "5", *extra]


def assert_same_training(data: Path, whole: str, resumed: str, last_epoch: int) -> None:
    """Bitwise-equal exported draft and fp32 last checkpoint, and the same log step by step."""
    for name in ("draft/model.safetensors", f"checkpoints/{last_epoch}/model.safetensors"):
        assert sha256(data / whole / name) == sha256(data / resumed / name), name
    with safe_open(data / resumed / "draft" / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # the export stays bf16
    with safe_open(data / resumed / "checkpoints" / str(last_epoch) / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert read_log(data / whole / LOG) == read_log(data / resumed / LOG)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, temperature", [("muon", "0.7"), ("adamw", "1")])
def test_resume_mid_epoch_after_sigkill_equals_the_uninterrupted_run(small_data, flat_target, optimizer, temperature):
    """Bitwise on CPU, with either optimizer: same batches, fp32 weights and optimizer state
    (Muon's momentum, AdamW's moments and step count), the noise RNG restored; the target's
    temperature taken from the flag by both runs."""
    whole, killed = f"whole-{optimizer}", f"killed-{optimizer}"
    extra = ("--epochs", "2", "--optimizer", optimizer, "--target-temperature", temperature)
    stdout = run_script(SCRIPT, *small_args(small_data, flat_target, whole, *extra)).stdout
    assert f"recipe: {optimizer}" in stdout
    recipe = "kl loss to the target at temperature 0.7 over" if temperature == "0.7" else "kl loss over"
    assert f"{recipe} 3 TTT steps (decay 1) fed the dataset's tokens" in stdout
    script = [sys.executable, REPO_ROOT / SCRIPT]
    kill_after_step_checkpoint([*script, *small_args(small_data, flat_target, killed, *extra)],
                               small_data / killed / "checkpoints" / "steps")
    point = checkpoints.latest(small_data / killed / "checkpoints")
    assert point.skip_batches > 0 and point.epoch == 0  # killed in the middle of epoch 1
    resumed = run_script(SCRIPT, *small_args(small_data, flat_target, killed, *extra, "--resume")).stdout
    assert "resuming after step checkpoint" in resumed
    assert_same_training(small_data, whole, killed, last_epoch=1)
    # TensorBoard: the killed run's steps past its checkpoint purged, one curve as the uninterrupted run's
    curves = {name: tensorboard_scalars(small_data / name / "tensorboard" / "train") for name in (whole, killed)}
    for tag in ("train/loss", "train/full_acc_0", "train/grad_norm", "val/loss", "val/acceptance_length_k3"):
        assert curves[killed][tag] == curves[whole][tag], tag
    assert [s for s, _ in curves[whole]["train/loss"]] == list(range(1, 65))
    kept = checkpoints.numbered(small_data / whole / "checkpoints" / "steps")
    assert kept == [55, 60]  # the last two of every 5th step, the epoch ends (32, 64) excepted


# Runs 04 (argv[2:]) with a SIGKILL before the trainer's batch number argv[1] (0-based, counted from
# the start of the run): the kill lands between two batches of one accumulation group, where no
# signal sent from outside can be aimed.
KILL_INSIDE_GROUP = """
import os, runpy, signal, sys
from common.train.trainer import ProjectTrainer

kill_at, trained, train_step = int(sys.argv[1]), [], ProjectTrainer.train_step

def killing_train_step(self, micro, epoch):
    if len(trained) == kill_at:
        print(f"killed before batch {micro.index + 1} of a group of {micro.count}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    trained.append(micro.index)
    train_step(self, micro, epoch)

ProjectTrainer.train_step = killing_train_step
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_grad_accum_steps_and_a_kill_inside_a_group_resume_to_the_uninterrupted_run(small_data, flat_target,
                                                                                    tmp_path):
    """--grad-accum 2 on 13 packed batches an epoch (--total-seq-len 256): ceil(13 / 2) = 7 optimizer
    steps an epoch in the log, the last on the one batch left. SIGKILL between the two batches of a
    group (after step 4's checkpoint, one batch of group 5 accumulated); --resume redoes that group
    from its first batch: bitwise the uninterrupted run's weights, and its log."""
    extra = ("--epochs", "2", "--grad-accum", "2", "--total-seq-len", "256", "--save-every", "2", "--report-to", "none")
    settings, _ = TrainSettings.resolve(read_config_file(TINY_CONFIG), {"total_seq_len": 256, "val_ratio": 0.2})
    data = load_hidden_states(small_data / "hs")
    batches = len(make_loader(data, split_data(data, settings)[0], settings, 1, 0, train=True, pin_memory=False))
    assert batches == 13  # odd: each epoch ends with a group of one
    run_script(SCRIPT, *small_args(small_data, flat_target, "accum-whole", *extra), env=ONE_THREAD)
    train = [r for r in read_log(small_data / "accum-whole" / LOG) if "train" in r]
    assert [r["step"] for r in train] == list(range(14))
    assert [sum(1 for r in train if r["epoch"] == e) for e in range(2)] == [7, 7]
    assert all(r["tokens"] < min(t["tokens"] for t in train[:6]) for r in (train[6], train[13]))  # one pack

    script = tmp_path / "kill_inside_group.py"
    script.write_text(KILL_INSIDE_GROUP)
    killed = subprocess.run([sys.executable, str(script), "9", str(REPO_ROOT / SCRIPT),
                             *map(str, small_args(small_data, flat_target, "accum-killed", *extra))],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **ONE_THREAD})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "killed before batch 2 of a group of 2" in killed.stdout
    point = checkpoints.latest(small_data / "accum-killed" / "checkpoints")
    assert (point.epoch, point.skip_batches, point.position.global_step) == (0, 8, 4)
    resumed = run_script(SCRIPT, *small_args(small_data, flat_target, "accum-killed", *extra, "--resume"),
                         env=ONE_THREAD).stdout
    assert "(step 4): epoch 1 of 2, after batch 8" in resumed
    assert_same_training(small_data, "accum-whole", "accum-killed", last_epoch=1)


@pytest.mark.slow
def test_curves_in_tensorboard_and_wandb_continue_on_resume(small_data, flat_target):
    """--report-to tensorboard wandb (W&B offline): every --log-every 4 steps the window's mean loss and
    accuracies, tokens/s, gradient norm and both groups' learning rates; each validation pass's loss and
    acceptance length at each k; the W&B run id kept in the checkpoint and continued by --resume."""
    out, env = small_data / "tracked", {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    flags = ("--report-to", "tensorboard", "wandb", "--log-every", "4")
    first = run_script(SCRIPT, *small_args(small_data, flat_target, "tracked", "--epochs", "1", *flags), env=env).stdout
    assert f"reporting to tensorboard: {out / 'tensorboard' / 'train'}; wandb: " in first
    curves = tensorboard_scalars(out / "tensorboard" / "train")
    records = read_log(out / LOG)
    train = {r["step"]: r for r in records if "train" in r}
    reported = [s + 1 for s in sorted(train) if (s + 1) % 4 == 0]
    for tag in ("train/loss", "train/loss_2", "train/full_acc_0", "train/cond_acc_1", "train/tokens_per_s",
                "train/grad_norm", "train/lr/muon", "train/lr/adamw"):
        assert [s for s, _ in curves[tag]] == reported, tag
    first_window = [train[s]["train"]["loss"] for s in range(4)]
    assert curves["train/loss"][0][1] == pytest.approx(sum(first_window) / 4, rel=1e-6)
    assert curves["train/grad_norm"][0][1] == pytest.approx(train[3]["grad_norm"], rel=1e-6)
    assert curves["train/lr/muon"][1][1] == pytest.approx(train[7]["lrs"]["muon"], rel=1e-6)
    val_step = next(r["step"] for r in records if "val" in r)
    for tag in ("val/loss", "val/full_acc_2", "val/acceptance_length_k1", "val/acceptance_length_k3",
                "epoch/tokens_per_s"):
        assert [s for s, _ in curves[tag]] == [val_step], tag
    run_id = json.loads((out / "checkpoints" / "0" / checkpoints.STATE_FILE).read_text())["trackers"]["wandb_run_id"]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(f"-{run_id}") and (runs[0] / "files").is_dir()

    resumed = run_script(SCRIPT, *small_args(small_data, flat_target, "tracked", "--epochs", "2", *flags, "--resume"),
                         env=env).stdout
    assert "resuming after checkpoint" in resumed
    runs = sorted((out / "wandb").glob("offline-run-*"))  # one folder per process, both of the one run id
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)
    curves = tensorboard_scalars(out / "tensorboard" / "train")
    train = sorted(r["step"] for r in read_log(out / LOG) if "train" in r)
    assert [s for s, _ in curves["train/loss"]] == [s + 1 for s in train if (s + 1) % 4 == 0]
    assert len(curves["val/loss"]) == 2 and curves["val/loss"][0][0] == val_step


@pytest.mark.slow
def test_torchrun_two_ranks_on_cpu_kill_and_resume(small_data, flat_target):
    """The library's distributed path on gloo: FSDP sharding, its distributed checkpointer behind
    our staging, the packing sampler over 2 ranks; killed mid-epoch, resumed, bitwise equal."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                REPO_ROOT / SCRIPT]
    whole = subprocess.run([*map(str, torchrun), *map(str, small_args(small_data, flat_target, "ranks2", "--epochs",
                                                                       "1"))],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "x 2 rank(s)" in whole.stdout and "recipe: muon" in whole.stdout  # Muon on FSDP-sharded matrices
    assert whole.stdout.count("reporting to tensorboard") == 1  # rank 0 alone reports: one writer, one event file
    assert len(list((small_data / "ranks2" / "tensorboard" / "train").glob("events.out.tfevents.*"))) == 1
    kill_after_step_checkpoint([*torchrun, *small_args(small_data, flat_target, "ranks2_killed", "--epochs", "1")],
                               small_data / "ranks2_killed" / "checkpoints" / "steps")
    assert checkpoints.latest(small_data / "ranks2_killed" / "checkpoints").skip_batches > 0
    resumed = subprocess.run([*map(str, torchrun), *map(str, small_args(small_data, flat_target, "ranks2_killed",
                                                                         "--epochs", "1", "--resume"))],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step checkpoint" in resumed.stdout
    assert_same_training(small_data, "ranks2", "ranks2_killed", last_epoch=0)
    curves = [tensorboard_scalars(small_data / name / "tensorboard" / "train") for name in ("ranks2", "ranks2_killed")]
    assert curves[1]["train/loss"] == curves[0]["train/loss"]  # rank 0's averaged metrics, continued on resume
    for rank in (0, 1):  # every rank's generators were saved
        assert (small_data / "ranks2_killed" / "checkpoints" / "0" / checkpoints.rng_file(rank)).is_file()


def test_hidden_states_and_vocabulary_of_different_prepared_runs_are_refused(tmp_path, flat_target):
    write_hidden_states(tmp_path / "hs", flat_target, num_samples=4)
    write_vocab_folder(tmp_path / "vocab", load_target_info(flat_target, trust_remote_code=True).vocab_size)
    for path, fingerprint in ((tmp_path / "hs" / "data_config.json", "1" * 16),
                              (tmp_path / "vocab" / "vocab_report.json", "2" * 16)):
        path.write_text(json.dumps({**json.loads(path.read_text()), "prepared_fingerprint": fingerprint}))
    with pytest.raises(PipelineError, match=r"hidden states .*hs and vocabulary .*vocab come from different runs "
                                            r"of 01_prepare_data\.py \(prepared fingerprints 1{16} and 2{16}\)"):
        train_in_process("--target", flat_target, "--draft-config", TINY_CONFIG, "--data", tmp_path / "hs",
                         "--vocab", tmp_path / "vocab", "--output", tmp_path / "out", "--epochs", "1")


# --- bad input -------------------------------------------------------------------------------


def bad_input_args(trained: TrainedRun, output: Path, **paths: Path) -> list[str | Path]:
    """04's arguments on the trained run's inputs, with some replaced, writing into `output`."""
    defaults = {"data": trained.run / "hidden_states", "vocab": trained.run / "vocab", "output": output}
    defaults.update(paths)
    args = ["--target", trained.target, "--trust-remote-code", "--draft-config", TINY_CONFIG,
            "--total-seq-len", str(SEQ)]
    for name, value in defaults.items():
        args += [f"--{name}", value]
    return args


@pytest.mark.slow
def test_missing_data_folder_exits_with_one_line(trained, tmp_path):
    proc = run_in_process(SCRIPT, *bad_input_args(trained, tmp_path, data=tmp_path / "nowhere"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (f"error: hidden states {tmp_path / 'nowhere'}: no such folder "
                                                    "(run 02_extract_hidden_states.py first)")


@pytest.mark.slow
def test_empty_data_folder(trained, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipelineError, match="no data_config.json"):
        train_in_process(*bad_input_args(trained, tmp_path / "out", data=tmp_path / "empty"))
    shutil.copy(trained.run / "hidden_states" / "data_config.json", tmp_path / "empty")
    with pytest.raises(PipelineError, match="no data_\\*.pt files"):
        train_in_process(*bad_input_args(trained, tmp_path / "out", data=tmp_path / "empty"))


@pytest.mark.slow
def test_stray_pt_file_in_data_folder(trained, tmp_path):
    data = shutil.copytree(trained.run / "hidden_states", tmp_path / "hs")
    shutil.copy(trained.run / "vocab" / "t2d.pt", data / "00000" / "t2d.pt")
    with pytest.raises(PipelineError, match=f"{data / '00000' / 't2d.pt'} is not a hidden-state file"):
        train_in_process(*bad_input_args(trained, tmp_path / "out", data=data))


@pytest.mark.slow
def test_data_hidden_size_differs_from_draft_config(trained, tmp_path):
    data = write_hidden_states(tmp_path / "hs", trained.target, num_samples=4, hidden=32)
    with pytest.raises(PipelineError) as error:
        train_in_process(*bad_input_args(trained, tmp_path / "out", data=data))
    assert str(error.value) == (f"hidden states {data} have hidden size 32 (data_config.json), "
                                f"but draft config {TINY_CONFIG} has hidden_size 64")


@pytest.mark.slow
def test_t2d_length_differs_from_target_vocabulary(trained, tmp_path):
    vocab = write_vocab_folder(tmp_path / "vocab", vocab_size=5000)
    with pytest.raises(PipelineError, match="t2d covers 5000 ids, the target has 163840"):
        train_in_process(*bad_input_args(trained, tmp_path / "out", vocab=vocab))


@pytest.mark.slow
def test_checkpoint_of_another_config_is_refused_on_resume(trained, tmp_path):
    shutil.copytree(trained.run / "checkpoints", tmp_path / "out" / "checkpoints")
    data = json.loads(TINY_CONFIG.read_text())
    data["model"]["intermediate_size"] = 128
    (tmp_path / "other.json").write_text(json.dumps(data))
    args = bad_input_args(trained, tmp_path / "out")
    args[args.index("--draft-config") + 1] = tmp_path / "other.json"
    with pytest.raises(PipelineError) as error:
        train_in_process(*args, "--resume")
    checkpoint = tmp_path / "out" / "checkpoints" / "1"
    assert f"checkpoint {checkpoint} was trained with another draft config" in str(error.value)
    assert "intermediate_size 256 there, 128 now" in str(error.value)


@pytest.mark.slow
def test_checkpoint_of_another_optimizer_is_refused_on_resume(trained, tmp_path):
    """The recorded settings name the flag; a checkpoint of an earlier version (no settings recorded)
    is still refused by its optimizer's parameter groups, naming the checkpoint."""
    out = tmp_path / "out"
    shutil.copytree(trained.run / "checkpoints", out / "checkpoints")
    folder = out / "checkpoints" / "1"
    with pytest.raises(PipelineError) as error:
        train_in_process(*bad_input_args(trained, out), "--optimizer", "adamw", "--resume")
    assert str(error.value).startswith(f"--optimizer adamw: checkpoint {folder} was trained with optimizer muon")
    state = json.loads((folder / checkpoints.STATE_FILE).read_text())
    del state["settings"]
    (folder / checkpoints.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(PipelineError) as error:
        train_in_process(*bad_input_args(trained, out), "--optimizer", "adamw", "--resume")
    assert str(error.value).startswith(f"checkpoint {folder} was trained with another optimizer set-up (parameter "
                                       "groups of [8, 5] there, [15] now with --optimizer adamw)"), str(error.value)


@pytest.mark.slow
def test_draft_config_of_another_hidden_size(trained, tmp_path):
    with pytest.raises(PipelineError, match="draft config .*draft_kimi_k25.json has hidden_size 7168, but target"):
        train_in_process(*bad_input_args(trained, tmp_path), "--draft-config", KIMI_CONFIG)
