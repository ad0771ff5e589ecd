"""Benchmark of step 04's training speed, side by side in one run: 04's training tokens/s against
upstream speculators 0.9.0's own trainer on the same states, shape and settings, and against the
draft's bare step on the same batches already in memory; then where 04's step time goes.

    python bench/bench_04_train.py [--target flat|kimi|smollm2|DIR] [--draft-config FILE] [--run-dir DIR]
        [--repeats 3] [--json FILE] [--setup-upstream | --no-upstream] [--no-tracker-ratio]
        [--conversations 8]

1. 01 -> 02 -> 03 once into RUN_DIR (default bench/out/train04-<target>). The miniatures (and a
   folder): the demo conversations, a 2048-token draft vocabulary, as bench/bench_04_recipe.py
   prepares them, trained with configs/draft_tiny.json. `--target smollm2`, the real model's
   shape: the first `--conversations` ShareGPT conversations (scripts/fetch_sharegpt.py; 8 give
   7,929 training tokens, 5 packed steps of up to 2,048 tokens) and the draft config's vocabulary
   (32,000 of 49,152 ids), trained with configs/draft_smollm2.json. `--draft-config` picks another.
2. Each repeat, alternating: `04_train.py --epochs 1`, once reporting to TensorBoard (the default) and
   once with `--report-to none` (skipped by `--no-tracker-ratio`), the draft config's recipe
   otherwise (configs/draft_tiny.json: Muon, 3 TTT steps fed the dataset's tokens, draft lm_head
   trained, noise, 1,024-token packs; configs/draft_smollm2.json the same at 2,048) as a
   subprocess, its epoch's tokens/s from train_report.json; upstream's trainer on the same rows
   (bench/upstream/adapter.py: its own environment .venv-speculators/, created by
   scripts/setup_speculators_env.sh, or by `--setup-upstream`; its variant `upstream-muon-head`, the same recipe) for one
   epoch, timed around its `train_epoch`; and the bare step: the draft and optimizer as 04 builds
   them (04's loss installed and the host memory taken as 04 does), forward + backward + clip + optimizer +
   schedule over the epoch's collated batches held in a list (no loader, no Trainer, no metrics,
   no checkpoint: the ceiling of this machine).
   Each figure is one epoch's training time (validation and export excluded on both sides).
3. A profile of one more 04 epoch, run in this process through 04's own `main` with timers around
   the data path, the draft's forward (its verifier-logits and loss part apart), backward, the
   gradient clip, the optimizer step (Muon's and AdamW's apart), the schedule and checkpoint writes.

Prints the medians and `ratio_vs_upstream` (goal >= 1.0), `ratio_vs_bare_step` (goal >= 0.9) and
`ratio_tensorboard_vs_no_tracker` (04 as run by default, reporting to TensorBoard, against
`--report-to none`; goal >= 0.98) and the optimizer step's share of the training time, written with
the profile to FILE by `--json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LRScheduler

from bench.bench_04_recipe import prepare, resolve, target_args
from bench.upstream import adapter as upstream
from common.atomic import write_json
from common.defaults import REPO_ROOT
from common.draft import patch
from common.draft.model import TINY_CONFIG, build_draft, read_config_file, speculator_config
from common.hidden_states.loader import epoch_tokens, load_hidden_states, make_loader, split_data
from common.target.config import load_target_info
from common.train import trainer as project_trainer
from common.train.host_memory import keep_freed_memory
from common.train.optimizers import MuonWithAdamW, build_optimizer, build_scheduler
from common.train.settings import TrainSettings
from common.vocab import load_vocab

UPSTREAM_VARIANT = "upstream-muon-head"  # Muon, lm_head trained: 04's defaults in upstream's trainer
OPTIMIZER_PHASES = ("optimizer step: Muon", "optimizer step: AdamW")
PHASES = ("data (load, noise, collate)", "draft forward", "verifier logits", "loss and metrics", "backward",
          "gradient clip and schedule", *OPTIMIZER_PHASES, "checkpoint writes", "other (metrics log, Trainer)")
AFTER_EPOCH = ("validation pass", "epoch checkpoint")  # once per epoch, outside its training time


class Epoch:
    """One training epoch of the draft config's settings on the run's states: 04's split, the
    training files and their tokens (both trainers train on exactly these)."""

    def __init__(self, run_dir: Path, config: Path = TINY_CONFIG) -> None:
        self.settings = TrainSettings.resolve(read_config_file(config), {"epochs": 1})[0]
        self.data = load_hidden_states(run_dir / "hidden_states")
        self.files, _ = split_data(self.data, self.settings)
        self.tokens = epoch_tokens(self.data, self.files, self.settings.total_seq_len)


# --- 04, as a subprocess ---

def time_04(run_dir: Path, target: Path, config: Path, out: Path, report_to: str = "tensorboard") -> float:
    """Tokens/s of one epoch of `04_train.py` (its train_report.json), reporting to `report_to`."""
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "04_train.py"), "--run-dir", str(run_dir),
                           *map(str, target_args(target)), "--draft-config", str(config), "--output", str(out),
                           "--epochs", "1", "--report-to", report_to], cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"04_train.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((out / "train_report.json").read_text())["tokens_per_second"]


# --- upstream's trainer, as a subprocess in its environment ---

def time_upstream(run_dir: Path, target: Path, config: Path, out: Path) -> float:
    """Tokens/s of one epoch of speculators 0.9.0's trainer on the same rows."""
    seconds = upstream.timed_epochs(upstream.convert_data(run_dir, target, config), target, out,
                                    upstream.VARIANTS[UPSTREAM_VARIANT][1], epochs=1, config=config)
    return Epoch(run_dir, config).tokens / seconds[-1]


# --- the bare step ---

def bare_step(run_dir: Path, target: Path, config_file: Path) -> tuple[float, int]:
    """(tokens/s, steps) of forward + backward + clip + optimizer + schedule over one epoch's
    collated batches held in memory, the draft, its loss and optimizer as 04 builds them."""
    epoch = Epoch(run_dir, config_file)
    settings = epoch.settings
    keep_freed_memory()  # the host memory as 04 takes it on a CPU
    patch.apply(trust_remote_code=True, compile_forward=False, loss=settings.loss,  # as 04 does on a CPU
                target_temperature=settings.target_temperature,
                activation_checkpointing=settings.activation_checkpointing)
    info = load_target_info(target, trust_remote_code=True)
    vocab = load_vocab(run_dir / "vocab", info.vocab_size)
    config = speculator_config(read_config_file(config_file).model, info, vocab.d2t.numel(),
                               epoch.data.config.layer_ids, settings.ttt_steps)
    batches = list(make_loader(epoch.data, epoch.files, settings, 1, 0, train=True, pin_memory=False))
    torch.manual_seed(settings.seed)
    model = build_draft(config, vocab.t2d, vocab.d2t)
    project_trainer.prepare_draft(model, settings)
    model.train()
    opt = build_optimizer(model, settings)
    scheduler = build_scheduler(opt, settings, len(batches))
    kwargs = settings.train_call_kwargs()
    start = time.perf_counter()
    for batch in batches:
        _tokens, loss, _metrics = model(**batch, **kwargs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
    return epoch.tokens / (time.perf_counter() - start), len(batches)


# --- the profile of one 04 epoch, in this process ---

class Profile:
    """Seconds per phase of the epochs run under `instrumented()`. The phases divide the Trainer's
    `train_epoch` time (`train`); validation and the epoch checkpoint come after it, apart."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.train = 0.0
        self.steps = 0

    def timed(self, phase: str, function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        return wrapper

    def rows(self) -> list[tuple[str, float, float]]:
        """(phase, ms per step, share of the epoch's training time): the draft's forward less its
        verifier-logits and loss parts, the data path less the step checkpoints written between
        batches, "other" what no timer covers."""
        s = defaultdict(float, self.seconds)
        s["draft forward"] = s["forward"] - s["verifier logits"] - s["loss and metrics"]
        s["data (load, noise, collate)"] = s["next batch"] - s["checkpoint writes"]
        s["other (metrics log, Trainer)"] = self.train - sum(s[p] for p in PHASES[:-1])
        per_step = 1000 / max(self.steps, 1)
        return [(p, per_step * s[p], s[p] / self.train) for p in (*PHASES, *AFTER_EPOCH)]


@contextmanager
def swapped(owner: object, name: str, value: object) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextmanager
def instrumented(profile: Profile) -> Iterator[None]:
    """Timers around the phases of 04's step, on the classes and functions 04 calls, for the block."""
    from speculators.models.eagle3 import core
    from speculators.models.eagle3.core import Eagle3DraftModel

    trainer_class = project_trainer.ProjectTrainer
    apply, train_epoch, setup_optimizer = patch.apply, trainer_class.train_epoch, trainer_class.setup_optimizer
    batches_of = trainer_class.epoch_batches

    def apply_then_time(**kwargs) -> None:  # 04 installs its forward through the patch; the timer wraps that
        apply(**kwargs)
        core.compute_metrics = profile.timed("loss and metrics", core.compute_metrics)  # the patch's or the library's
        forward = Eagle3DraftModel.forward

        def timed_forward(model, *args, **kw):
            if not model.training:  # a validation pass
                return forward(model, *args, **kw)
            if "forward" not in vars(model.verifier_lm_head):
                model.verifier_lm_head.forward = profile.timed("verifier logits", model.verifier_lm_head.forward)
            return profile.timed("forward", forward)(model, *args, **kw)
        Eagle3DraftModel.forward = timed_forward

    def timed_train_epoch(self, epoch: int) -> None:
        start = time.perf_counter()
        train_epoch(self, epoch)
        profile.train += time.perf_counter() - start

    def timed_batches(self, loader, epoch: int) -> Iterator[dict]:
        batches = batches_of(self, loader, epoch)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                profile.seconds["next batch"] += time.perf_counter() - start
            profile.steps += 1
            yield batch

    def timed_setup_optimizer(self) -> None:  # the timers are instance attributes, not in the state_dict
        setup_optimizer(self)
        if isinstance(self.opt, MuonWithAdamW):  # its step calls its members' in turn
            self.opt.muon.step = profile.timed(OPTIMIZER_PHASES[0], self.opt.muon.step)
            self.opt.adamw.step = profile.timed(OPTIMIZER_PHASES[1], self.opt.adamw.step)
        else:
            self.opt.step = profile.timed(OPTIMIZER_PHASES[1], self.opt.step)

    swaps = ((patch, "apply", apply_then_time), (trainer_class, "train_epoch", timed_train_epoch),
             (trainer_class, "epoch_batches", timed_batches), (trainer_class, "setup_optimizer", timed_setup_optimizer),
             (trainer_class, "save_step_checkpoint", profile.timed("checkpoint writes", trainer_class.save_step_checkpoint)),
             (trainer_class, "save_checkpoint", profile.timed("epoch checkpoint", trainer_class.save_checkpoint)),
             (trainer_class, "val_epoch", profile.timed("validation pass", trainer_class.val_epoch)),
             (core, "compute_metrics", core.compute_metrics),  # restored after the block
             (torch.Tensor, "backward", profile.timed("backward", torch.Tensor.backward)),
             (torch.nn.utils, "clip_grad_norm_", profile.timed("gradient clip and schedule",
                                                                torch.nn.utils.clip_grad_norm_)),
             (LRScheduler, "step", profile.timed("gradient clip and schedule", LRScheduler.step)),
             (Eagle3DraftModel, "forward", Eagle3DraftModel.forward))  # restored after the block
    with ExitStack() as stack:
        for owner, name, value in swaps:
            stack.enter_context(swapped(owner, name, value))
        yield


def profile_04(run_dir: Path, target: Path, config: Path, out: Path) -> Profile:
    """One epoch of 04's own `main`, in this process, under `instrumented`."""
    spec = importlib.util.spec_from_file_location("stage_04_train", REPO_ROOT / "04_train.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    profile = Profile()
    out.mkdir(parents=True)
    with instrumented(profile), (out / "04.log").open("w") as log, redirect_stdout(log), redirect_stderr(log):
        stage.main(["--run-dir", str(run_dir), *map(str, target_args(target)), "--draft-config", str(config),
                    "--output", str(out), "--epochs", "1"])
    return profile


def run(target_name: str, run_dir: Path, repeats: int, with_upstream: bool, setup_upstream: bool = False,
        config: Path | None = None, tracker_ratio: bool = True, conversations: int = 8) -> dict:
    target, config = resolve(target_name, config)
    run_dir = run_dir.resolve()
    prepare(run_dir, target_name, target, config, conversations=conversations)
    if with_upstream and not upstream.available() and setup_upstream:
        subprocess.run(["bash", str(REPO_ROOT / upstream.SETUP)], cwd=REPO_ROOT, check=True)
    if with_upstream and not upstream.available():
        print(upstream.missing_message() + " or pass --setup-upstream")
        with_upstream = False
    rates: dict[str, list[float]] = {"04": [], "04_no_tracker": [], "upstream": [], "bare_step": []}
    steps = 0
    loads = [os.getloadavg()[0]]  # the machine's 1-minute load average, before and after each repeat
    with tempfile.TemporaryDirectory(dir=run_dir) as tmp:
        for r in range(repeats):
            rates["04"].append(time_04(run_dir, target, config, Path(tmp) / f"04-{r}"))
            if tracker_ratio:
                rates["04_no_tracker"].append(time_04(run_dir, target, config, Path(tmp) / f"04-none-{r}",
                                                      report_to="none"))
            if with_upstream:
                rates["upstream"].append(time_upstream(run_dir, target, config, Path(tmp) / f"upstream-{r}"))
            rate, steps = bare_step(run_dir, target, config)
            rates["bare_step"].append(rate)
            loads.append(os.getloadavg()[0])
            print(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in rates.items() if v)
                  + f" (load {loads[-1]:.2f})", flush=True)
        profile = profile_04(run_dir, target, config, Path(tmp) / "profile")
    medians = {k: statistics.median(v) for k, v in rates.items() if v}
    return {"target": str(target), "draft_config": str(config), "run_dir": str(run_dir), "repeats": repeats,
            "tokens_per_epoch": Epoch(run_dir, config).tokens, "steps_per_epoch": steps,
            "torch_threads": torch.get_num_threads(), "load_average_1min": loads, "tokens_per_s": rates,
            "median_tokens_per_s": medians,
            "ratio_vs_upstream": medians["04"] / medians["upstream"] if "upstream" in medians else None,
            "ratio_vs_bare_step": medians["04"] / medians["bare_step"],
            "ratio_tensorboard_vs_no_tracker": (medians["04"] / medians["04_no_tracker"]
                                                if "04_no_tracker" in medians else None),
            "profile": [{"phase": p, "ms_per_step": ms, "share_of_training": share} for p, ms, share in profile.rows()],
            "optimizer_share": sum(share for p, _, share in profile.rows() if p in OPTIMIZER_PHASES),
            "profile_steps": profile.steps, "profile_train_seconds": profile.train}


def report(result: dict) -> str:
    m = result["median_tokens_per_s"]
    loads = result["load_average_1min"]
    lines = [f"target {result['target']}, {Path(result['draft_config']).name}: {result['tokens_per_epoch']:,} training "
             f"tokens per epoch in {result['steps_per_epoch']} steps, medians of {result['repeats']}, "
             f"{result['torch_threads']} torch thread(s) here, load average {min(loads):.2f}-{max(loads):.2f}",
             f"04: {m['04']:,.0f} tok/s" + (f", upstream speculators 0.9.0: {m['upstream']:,.0f} tok/s" if "upstream" in m
                                            else ", upstream not run") + f", bare step: {m['bare_step']:,.0f} tok/s"]
    if result["ratio_vs_upstream"] is not None:
        ok = "met" if result["ratio_vs_upstream"] >= 1.0 else "NOT met"
        lines.append(f"ratio vs upstream {result['ratio_vs_upstream']:.3f} (goal >= 1.0: {ok})")
    ok = "met" if result["ratio_vs_bare_step"] >= 0.9 else "NOT met"
    lines.append(f"ratio vs bare step {result['ratio_vs_bare_step']:.3f} (goal >= 0.9: {ok})")
    if result["ratio_tensorboard_vs_no_tracker"] is not None:
        ok = "met" if result["ratio_tensorboard_vs_no_tracker"] >= 0.98 else "NOT met"
        lines.append(f"ratio with --report-to tensorboard vs none {result['ratio_tensorboard_vs_no_tracker']:.3f} "
                     f"(no tracker: {m['04_no_tracker']:,.0f} tok/s; goal >= 0.98: {ok})")
    lines.append(f"where 04's step time goes ({result['profile_steps']} steps, {result['profile_train_seconds']:.1f} s "
                 "of training; the last two once per epoch, after it):")
    lines += [f"  {row['phase']:<34} {row['ms_per_step']:>8.1f} ms/step {row['share_of_training']:>7.1%}"
              for row in result["profile"]]
    lines.append(f"the optimizer step (Muon and AdamW): {result['optimizer_share']:.1%} of the training time")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="flat",
                        help="flat or kimi (the miniatures), smollm2 (the built-in real target) or a target folder")
    parser.add_argument("--draft-config", type=Path, default=None,
                        help="default: configs/draft_smollm2.json for smollm2, configs/draft_tiny.json otherwise")
    parser.add_argument("--conversations", type=int, default=8,
                        help="smollm2: ShareGPT conversations prepared into a new run folder (default: %(default)s)")
    parser.add_argument("--no-tracker-ratio", action="store_true",
                        help="skip the --report-to none runs (the TensorBoard vs no-tracker ratio)")
    parser.add_argument("--run-dir", type=Path, default=None, help="default: bench/out/train04-<target>")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-upstream", action="store_true", help="skip speculators 0.9.0's trainer")
    parser.add_argument("--setup-upstream", action="store_true",
                        help=f"create .venv-speculators/ first when it is missing ({upstream.SETUP}, about 2 minutes)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures and the profile here")
    args = parser.parse_args()
    run_dir = args.run_dir or REPO_ROOT / "bench" / "out" / f"train04-{Path(args.target).name}"
    result = run(args.target, run_dir, args.repeats, not args.no_upstream, args.setup_upstream, args.draft_config,
                 not args.no_tracker_ratio, args.conversations)
    print(report(result))
    if args.json is not None:
        write_json(args.json, result)
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
