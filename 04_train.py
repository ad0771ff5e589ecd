"""Step 04: train the EAGLE-3 draft on step 02's hidden states with speculators' Trainer.

Builds the draft from a config file of configs/ and the target (rope settings, vocabulary and
norm epsilon copied from it; Kimi-K2.5's nested checkpoint read through common/draft/patch.py), trains
it through the library's data path and Trainer, checkpoints every epoch, and exports the final
draft in speculators' format (bf16, vLLM-loadable).

Usage:
    python 04_train.py                                   # default target and runs/default
    python 04_train.py --data RUN/hidden_states --vocab RUN/vocab --target DIR --output RUN \
        [--draft-config configs/draft_tiny.json] [--epochs 3] [--lr 2e-3] [--ttt-steps 3] [--save-every N]
        [--optimizer muon|adamw] [--ttt-inputs dataset|draft] [--freeze-draft-lm-head] [--init normal|torch]
        [--resume]
    python 04_train.py --target /models/Kimi-K2.5 --trust-remote-code --run-dir RUN   # one GPU,
        # configs/draft_kimi_k25.json
    torchrun --nproc-per-node 8 04_train.py --target /models/Kimi-K2.5 --trust-remote-code --run-dir RUN
        # the library's FSDP path, one rank per GPU (on a machine without GPUs: one CPU process per rank, gloo)

Flags of the `training` section override the config file (each override is printed). Writes
OUTPUT/checkpoints/<epoch>/ after each epoch and OUTPUT/checkpoints/steps/<step>/ every
`--save-every N` steps (the last two kept): fp32 weights and optimizer, scheduler, RNG states and
the data position, so `--resume` continues from the latest one, mid-epoch included, exactly as an
uninterrupted run would (common/train/checkpoints.py). Also OUTPUT/draft/ (bf16), OUTPUT/train_log.jsonl
(one line per step and validation pass), OUTPUT/train_log.png and OUTPUT/train_report.json; the
curves also go to the experiment trackers of `--report-to` (TensorBoard into OUTPUT/tensorboard/train/
by default: `tensorboard --logdir runs/`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common.cli import resolve_target, run_main, stage_dir, stage_parser
from common.draft import patch
from common.draft.eagle31 import norms_of
from common.draft.model import (
    build_draft,
    check_draft_fits,
    default_config,
    read_config_file,
    speculator_config,
)
from common.engine_device import default_device
from common.errors import PipelineError
from common.hidden_states.loader import SPLIT_FILE, check_data_fits, epoch_tokens, make_loader, split_data, split_record
from common.online.options import OnlineOptions
from common.online.states import StateEngineError, open_states
from common.prepare.fingerprints import check_same_prepared
from common.target.config import load_target_info
from common.trackers import add_report_args, resolve_report_to
from common.train.checkpoints import check_resumable, check_same_settings, last_checkpoint_note, split_warning
from common.train.distributed import leave_rank, setup_distributed, teardown_distributed
from common.train.host_memory import keep_freed_memory
from common.train.metrics import LOG_FILE, MetricsLog, metrics_logging
from common.train.settings import TrainSettings, flag_specs
from common.train.summary import export_chosen, report_run
from common.train.tracking import train_tracking
from common.train.trainer import (
    CHECKPOINTS,
    DRAFT,
    ProjectTrainer,
    optimizer_steps,
    prepare_checkpoints,
    prepare_draft,
    trainer_config,
)
from common.vocab import load_vocab

TRAINING_FLAGS = flag_specs()  # one flag per TrainSettings field; each overrides the config file's value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = stage_parser(__doc__)
    paths = parser.add_argument_group("inputs and outputs")
    paths.add_argument("--data", type=Path, help="hidden states of step 02 (default: RUN_DIR/hidden_states)")
    paths.add_argument("--vocab", type=Path, help="t2d.pt/d2t.pt of step 03 (default: RUN_DIR/vocab)")
    paths.add_argument("--output", type=Path, help="folder for checkpoints/, draft/ and the logs (default: RUN_DIR)")
    model = parser.add_argument_group("model")
    model.add_argument("--draft-config", type=Path,
                       help="draft config file (default: configs/draft_tiny.json for the built-in target, "
                            "configs/draft_smollm2.json for --target smollm2, configs/draft_kimi_k25.json otherwise)")
    training = parser.add_argument_group("training (override the config file)")
    training.add_argument("--preset", type=Path, default=None,
                          help="run preset of configs/presets/ (10, 1000 or 500K samples): its training values "
                               "override the config file's, flags override both")
    for name, spec in TRAINING_FLAGS.items():
        training.add_argument("--" + name.replace("_", "-"), **spec)
    training.add_argument("--resume", action="store_true",
                          help="continue from the latest checkpoint in OUTPUT (epoch or step)")
    training.add_argument("--device", default="auto",
                          help="cpu, cuda or cuda:N (default: cuda if available; torchrun: one GPU per rank)")
    training.add_argument("--no-compile", action="store_true",
                          help="run the draft's forward eagerly on GPU too (it is always eager on CPU)")
    add_report_args(parser, report_to=False)  # --report-to is a training value (config file or flag)
    OnlineOptions.add_args(parser)
    args = parser.parse_args(argv)
    args.online = OnlineOptions.from_args(args)  # --online read here alone: its options, or None (02's files)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, world_size, rank, distributed = setup_distributed()
    code = train(args, world_size, rank, distributed)
    if distributed:
        leave_rank(code)  # under torchrun, without interpreter finalization (common/train/distributed.py)
    return code


def train(args: argparse.Namespace, world_size: int, rank: int, distributed: bool) -> int:
    is_main = rank == 0
    say = print if is_main else (lambda *_a, **_k: None)

    # 1. settings: the draft config file, overridden by flags
    target, trust_remote_code = resolve_target(args)
    config_file = read_config_file(args.draft_config or default_config(args.target))
    settings, overrides = TrainSettings.resolve(config_file, {k: getattr(args, k) for k in TRAINING_FLAGS},
                                                args.preset)
    for line in overrides:
        say(line)
    resolve_report_to(settings.report_to, say=lambda *_: None)  # a tracker not installed is refused here, not late
    device = torch.device(default_device(None if distributed else args.device))  # torchrun: one GPU per rank
    if device.type == "cpu":
        keep_freed_memory()  # the step's [tokens x vocabulary] tensors reuse freed memory (common/train/host_memory.py)
    patch.apply(trust_remote_code=trust_remote_code, compile_forward=device.type == "cuda" and not args.no_compile,
                loss=settings.loss, target_temperature=settings.target_temperature,
                activation_checkpointing=settings.activation_checkpointing)
    output = Path(args.output or args.run_dir)
    data_dir, vocab_dir = stage_dir(args, "hidden_states", args.data), stage_dir(args, "vocab", args.vocab)

    # 2. inputs: target, vocabulary maps, hidden states (02's files, or the target computing them), each
    #    checked against the others
    info = load_target_info(target, trust_remote_code)
    vocab = load_vocab(vocab_dir, info.vocab_size)
    check_draft_fits(config_file.model, config_file.path, info, vocab.d2t.numel(), vocab_dir)
    with open_states(args.online, data_dir, info, trust_remote_code, output, rank, world_size) as data:
        check_data_fits(data, config_file.model, config_file.path, info)
        check_same_prepared(("hidden states", data_dir), ("vocabulary", vocab_dir),
                            (data.config.prepared_fingerprint, vocab.report.prepared_fingerprint))

        # 3. draft model, and the epoch to start at
        config = speculator_config(config_file.model, info, vocab.d2t.numel(), data.config.layer_ids, settings.served_k)
        resume = prepare_checkpoints(output / CHECKPOINTS, args.resume, config, vocab.d2t, is_main)
        if resume is not None:
            check_same_settings(resume, vars(settings))  # applied from the resumed step, or refused
            if (warning := split_warning(resume)) is not None:
                say(warning)
        start_epoch = resume.epoch if resume is not None else 0
        if distributed:
            torch.distributed.barrier()  # rank 0 may have moved an earlier run's checkpoints aside
        torch.manual_seed(settings.seed)
        model = build_draft(config, vocab.t2d, vocab.d2t)
        prepare_draft(model, settings)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        say(f"draft: {config.transformer_layer_config.num_hidden_layers} layer(s), hidden {info.hidden_size}, "
            f"draft vocabulary {vocab.d2t.numel():,} of {info.vocab_size:,}, {params:,} trainable parameters, "
            f"aux layers {data.config.layer_ids}, rope theta {config.transformer_layer_config.rope_theta}, on {device}")
        say(f"recipe: {settings.optimizer}" + (f" (Muon lr {settings.muon_lr or settings.lr:g}, AdamW lr {settings.lr:g})"
                                                 if settings.optimizer == "muon" else f" (lr {settings.lr:g})")
            + f", {settings.loss} loss" + (f" to the target at temperature {settings.target_temperature:g}"
                                             if settings.target_temperature != 1.0 else "")
            + f" over {settings.ttt_steps} TTT steps (decay {settings.ttt_step_loss_decay:g}) fed "
            f"the {'dataset' if settings.ttt_inputs == 'dataset' else 'draft'}'s tokens, init "
            f"{settings.init}, draft lm_head {'frozen' if settings.freeze_draft_lm_head else 'trained'}; "
            f"chosen and exported for k = {settings.served_k}"
            + ("; EAGLE-3.1 norms: " + ", ".join(n for n, on in norms_of(config).items() if on)
               if any(norms_of(config).values()) else ""))

        # 4. data: the library's split, dataset, noise, packing sampler and collate
        train_files, val_files = split_data(data, settings)
        pin = device.type == "cuda"
        skips = data.skip_tally()  # damaged files skipped and counted, up to a share (hidden_states/skip_damaged.py)
        train_loader = make_loader(data, train_files, settings, world_size, rank, train=True, pin_memory=pin, tally=skips)
        val_loader = make_loader(data, val_files, settings, world_size, rank, False, pin, skips) if val_files else None
        tokens = epoch_tokens(data, train_files, settings.total_seq_len)
        say(f"data: {len(train_files):,} training / {len(val_files):,} validation samples, {tokens:,} tokens per epoch "
            f"in {optimizer_steps(len(train_loader), settings.grad_accum):,} optimizer steps of up to "
            f"{settings.grad_accum} x {settings.total_seq_len:,} tokens x {world_size} rank(s)")
        if resume is not None:
            check_resumable(resume, len(train_loader), world_size)
        if resume is not None and start_epoch < settings.epochs:
            say(f"resuming after {resume.describe(settings.epochs)}")

        # 5. training, its curves in the experiment trackers (rank 0; common/train/tracking.py)
        start_step = resume.position.global_step if resume is not None and resume.skip_batches else None
        params = {"training": vars(settings), "target": info.path, "draft_config": str(config_file.path),
                  "prepared_fingerprint": data.config.prepared_fingerprint, "layer_ids": data.config.layer_ids,
                  "train_samples": len(train_files), "val_samples": len(val_files), "world_size": world_size}
        with train_tracking(args, settings, output, resume, is_main, say, params) as tracking:
            log = (MetricsLog(output / LOG_FILE, start_epoch, settings.epochs, len(train_loader), tokens, start_step,
                              tracking) if is_main else None)
            with metrics_logging(log):
                trainer = ProjectTrainer(model, trainer_config(settings, output / CHECKPOINTS, args.resume,
                                                               distributed, device),
                                         settings, train_loader, val_loader, log, resume,
                                         tracking=bool(tracking.trackers), tracker_state=tracking.trackers.state())
                try:
                    trainer.run_training()
                except StateEngineError as e:
                    raise PipelineError(f"{e}; {last_checkpoint_note(output / CHECKPOINTS)}") from e
            tracking.summary(len(skips.skipped), data.summary())
        teardown_distributed()
        if not is_main:
            return 0

        # 6. export the best checkpoint by validation simulated acceptance length at the served k (the last
        #    without validation); 7. the summary (common/train/summary.py)
        split = split_record(data, train_files, val_files, settings, output / DRAFT)
        exported = export_chosen(output, config, settings.served_k, {SPLIT_FILE: split})
        report_run(output, exported, settings, overrides=overrides, data=data, train_files=train_files,
                   val_files=val_files, tokens=tokens, start_epoch=start_epoch, train_seconds=trainer.train_seconds,
                   state_waits=trainer.state_waits, skips=skips,
                   sources={"target": info.path, "data": str(data_dir), "vocab": str(vocab_dir),
                            "draft_config": str(config_file.path)})
        return 0


if __name__ == "__main__":
    run_main(main)
