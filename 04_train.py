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
(one line per step and validation pass), OUTPUT/train_log.png and OUTPUT/train_report.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common.cli import add_run_args, resolve_target, run_main, stage_dir
from common.data.fingerprints import check_same_prepared
from common.draft import patch
from common.draft.model import (
    KIMI_CONFIG,
    TINY_CONFIG,
    build_draft,
    check_draft_fits,
    export_draft,
    read_config_file,
    speculator_config,
)
from common.hidden_states.loader import (
    SPLIT_FILE,
    check_data_fits,
    epoch_tokens,
    load_hidden_states,
    make_loader,
    split_data,
    split_record,
)
from common.runtime import default_device
from common.target.config import load_target_info
from common.train.checkpoints import check_resumable, check_same_settings, numbered, split_warning
from common.train.distributed import setup_distributed, teardown_distributed
from common.train.metrics import (
    LOG_FILE,
    PLOT_FILE,
    MetricsLog,
    TrainReport,
    best_validation,
    last_validation,
    metrics_logging,
    read_log,
)
from common.train.settings import TrainSettings, flag_specs
from common.train.trainer import (
    CHECKPOINTS,
    DRAFT,
    ProjectTrainer,
    prepare_checkpoints,
    prepare_draft,
    trainer_config,
)
from common.vocab import load_vocab

TRAINING_FLAGS = flag_specs()  # one flag per TrainSettings field; each overrides the config file's value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    paths = parser.add_argument_group("inputs and outputs")
    paths.add_argument("--data", type=Path, help="hidden states of step 02 (default: RUN_DIR/hidden_states)")
    paths.add_argument("--vocab", type=Path, help="t2d.pt/d2t.pt of step 03 (default: RUN_DIR/vocab)")
    paths.add_argument("--output", type=Path, help="folder for checkpoints/, draft/ and the logs (default: RUN_DIR)")
    model = parser.add_argument_group("model")
    model.add_argument("--draft-config", type=Path,
                       help="draft config file (default: configs/draft_tiny.json for the built-in target, "
                            "configs/draft_kimi_k25.json otherwise)")
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
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank, world_size, rank, distributed = setup_distributed()
    is_main = rank == 0
    say = print if is_main else (lambda *_a, **_k: None)

    # 1. settings: the draft config file, overridden by flags
    target, trust_remote_code = resolve_target(args)
    config_file = read_config_file(args.draft_config or (TINY_CONFIG if args.target is None else KIMI_CONFIG))
    settings, overrides = TrainSettings.resolve(config_file, {k: getattr(args, k) for k in TRAINING_FLAGS},
                                                args.preset)
    for line in overrides:
        say(line)
    device = torch.device(default_device(None if distributed else args.device))  # torchrun: one GPU per rank
    patch.apply(trust_remote_code=trust_remote_code, compile_forward=device.type == "cuda" and not args.no_compile)
    output = Path(args.output or args.run_dir)
    data_dir, vocab_dir = stage_dir(args, "hidden_states", args.data), stage_dir(args, "vocab", args.vocab)

    # 2. inputs: target, vocabulary maps, hidden states, each checked against the others
    info = load_target_info(target, trust_remote_code)
    vocab = load_vocab(vocab_dir, info.vocab_size)
    data = load_hidden_states(data_dir)
    check_draft_fits(config_file.model, config_file.path, info, vocab.d2t.numel(), vocab_dir)
    check_data_fits(data, config_file.model, config_file.path, info)
    check_same_prepared(("hidden states", data_dir), ("vocabulary", vocab_dir),
                        (data.config.prepared_fingerprint, vocab.report.prepared_fingerprint))

    # 3. draft model, and the epoch to start at
    config = speculator_config(config_file.model, info, vocab.d2t.numel(), data.config.layer_ids, settings.ttt_steps)
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
        + f", TTT steps fed the {'dataset' if settings.ttt_inputs == 'dataset' else 'draft'}'s tokens, init "
        f"{settings.init}, draft lm_head {'frozen' if settings.freeze_draft_lm_head else 'trained'}")

    # 4. data: the library's split, dataset, noise, packing sampler and collate
    train_files, val_files = split_data(data, settings)
    pin = device.type == "cuda"
    skips = data.skip_tally()  # damaged files skipped and counted, up to a share (hidden_states/sample_files.py)
    train_loader = make_loader(data, train_files, settings, world_size, rank, train=True, pin_memory=pin, tally=skips)
    val_loader = make_loader(data, val_files, settings, world_size, rank, False, pin, skips) if val_files else None
    tokens = epoch_tokens(data, train_files, settings.total_seq_len)
    say(f"data: {len(train_files):,} training / {len(val_files):,} validation samples, {tokens:,} tokens per epoch "
        f"in {len(train_loader):,} steps of up to {settings.total_seq_len:,} tokens x {world_size} rank(s)")
    if resume is not None:
        check_resumable(resume, len(train_loader), world_size)
    if resume is not None and start_epoch < settings.epochs:
        say(f"resuming after {resume.describe(settings.epochs)}")

    # 5. training
    start_step = resume.position.global_step if resume is not None and resume.skip_batches else None
    log = (MetricsLog(output / LOG_FILE, start_epoch, settings.epochs, len(train_loader), tokens, start_step)
           if is_main else None)
    with metrics_logging(log):
        trainer = ProjectTrainer(model, trainer_config(settings, output / CHECKPOINTS, args.resume, distributed,
                                                       device),
                                 settings, train_loader, val_loader, log, resume)
        trainer.run_training()
    teardown_distributed()
    if not is_main:
        return 0

    # 6. export the best checkpoint by validation simulated acceptance length (the last without validation)
    epochs = numbered(output / CHECKPOINTS)
    records = read_log(output / LOG_FILE)
    best = best_validation(records, epochs)
    chosen = best.epoch if best else epochs[-1]
    because = ("best validation simulated acceptance length" if best
               else "last checkpoint (no validation pass: --val-ratio 0)")
    draft_dir = export_draft(output / CHECKPOINTS / str(chosen), config, output / DRAFT,
                             {SPLIT_FILE: split_record(data, train_files, val_files, settings, output / DRAFT)})
    print(f"exported checkpoint {output / CHECKPOINTS / str(chosen)} ({because}"
          + (f": {best.acceptance_length:.3f} after epoch {best.epoch + 1})" if best else ")"))

    # 7. summary
    validation = last_validation(records)
    for line in validation.lines() if validation else ["no validation pass (--val-ratio 0)"]:
        print(line)
    report = TrainReport(
        target=info.path, data=str(data_dir), vocab=str(vocab_dir), draft_config=str(config_file.path),
        settings=vars(settings), train_samples=len(train_files), val_samples=len(val_files), tokens_per_epoch=tokens,
        epochs_run=list(range(start_epoch, settings.epochs)),
        tokens_per_second=tokens / trainer.train_seconds if trainer.train_seconds else 0.0,
        checkpoints=[str(output / CHECKPOINTS / str(e)) for e in epochs], draft=str(draft_dir),
        log=str(output / LOG_FILE), plot=str(output / PLOT_FILE),
        validation=vars(validation) if validation else None, overrides=overrides,
        exported_checkpoint=str(output / CHECKPOINTS / str(chosen)), exported_because=because,
        best_validation=vars(best) if best else None, skipped_files=skips.skipped)
    report_path = report.save(output)
    print(f"trained epochs {start_epoch + 1}-{settings.epochs} of {settings.epochs} on {len(train_files):,} samples "
          f"({tokens:,} tokens per epoch, {report.tokens_per_second:,.0f} tok/s in the last epoch)"
          if report.epochs_run else f"nothing to train: all {settings.epochs} epochs have checkpoints")
    if skips.skipped:
        print(f"skipped {len(skips.skipped):,} of {len(data.files):,} hidden-state files that could not be used "
              f"(listed in {report_path}; 02_extract_hidden_states.py --verify redoes them)")
    print(f"outputs: {draft_dir} (draft), {output / CHECKPOINTS} ({len(epochs)} checkpoints), "
          f"{output / LOG_FILE}, {output / PLOT_FILE}, {report_path}")
    return 0


if __name__ == "__main__":
    run_main(main)
