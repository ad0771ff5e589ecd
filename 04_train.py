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
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from common.cli import add_run_args, resolve_target, run_main, stage_dir
from common.prepare.fingerprints import check_same_prepared
from common.draft import patch
from common.draft.eagle31 import norms_of
from common.draft.model import (
    KIMI_CONFIG,
    TINY_CONFIG,
    build_draft,
    check_draft_fits,
    export_draft,
    read_config_file,
    speculator_config,
)
from common.engine_device import Runtime, add_runtime_args, default_device
from common.errors import PipelineError
from common.hidden_states.capture import DEFAULT_BATCH_TOKENS, choose_layer_ids
from common.hidden_states.loader import (
    SPLIT_FILE,
    HiddenStateData,
    check_data_fits,
    epoch_tokens,
    load_hidden_states,
    make_loader,
    split_data,
    split_record,
)
from common.hidden_states.online import DEFAULT_PREFETCH, StateEngineError, open_online_states
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES
from common.target.config import TargetInfo, load_target_info
from common.target.device_plan import parse_size
from common.train.checkpoints import (
    check_resumable,
    check_same_settings,
    last_checkpoint_note,
    numbered,
    split_warning,
)
from common.train.distributed import leave_rank, setup_distributed, teardown_distributed
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
    online = parser.add_argument_group(
        "online (--online: the target computes each batch's hidden states as the draft trains; no 02 needed)")
    online.add_argument("--online", action="store_true",
                        help="compute the hidden states of 01's prepared rows with the target during training "
                             "instead of reading 02's files (same layer ids, dtype and storage rounding as 02)")
    online.add_argument("--prepared", type=Path, default=None,
                        help="--online: prepared dataset of 01 (default: RUN_DIR/prepared)")
    online.add_argument("--max-samples", type=int, default=None, help="--online: only the first N prepared rows")
    online.add_argument("--layer-ids", type=int, nargs="+", default=None, metavar="I",
                        help="--online: three auxiliary layer ids, vLLM convention (default: 2 N//2 N-3, as 02)")
    online.add_argument("--storage", choices=sorted(STORAGES), default=None,
                        help="--online: round the states as 02 --storage would store them (default: bf16)")
    online.add_argument("--batch-tokens", type=int, default=None,
                        help=f"--online: padded tokens per forward pass of the target (default: {DEFAULT_BATCH_TOKENS})")
    online.add_argument("--prefetch", type=int, default=None, metavar="N",
                        help=f"--online: batches whose states are computed ahead of the one training (default: "
                             f"{DEFAULT_PREFETCH}, at least 1); they hold N x total_seq_len x 4 x hidden x 2 bytes "
                             "of host memory (Kimi-K2.5, 8,192 tokens: 470 MB per batch)")
    online.add_argument("--max-disk", default=None, metavar="SIZE",
                        help="--online: keep the states of the first samples computed as 02's files in "
                             "RUN_DIR/hidden_states up to SIZE (bytes, or 500G, 5T, 2TiB), read by later epochs; "
                             "the rest are computed in every epoch (default: 0, none kept)")
    online.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                        help="--online --engine vllm on GPUs: vLLM's share of each GPU, the rest trains the draft "
                             "beside it (default: vLLM's 0.9; scripts/plan_kimi_k25.py --online prints the share "
                             "Kimi-K2.5 needs)")
    add_runtime_args(parser, "--online: compute the states", device=False, url=True,
                     url_help="--online --engine vllm: a hidden-state server all ranks share (started with "
                              "scripts/serve_hidden_states.py, e.g. http://host:8100) instead of an engine per rank")
    args = parser.parse_args(argv)
    check_online_flags(args)
    return args


ONLINE_ONLY = ("prepared", "max_samples", "layer_ids", "storage", "batch_tokens", "prefetch", "max_disk", "dtype",
               "device_map", "max_memory", "vllm_python", "vllm_url", "gpu_memory_utilization")


def check_online_flags(args: argparse.Namespace) -> None:
    """Flags of the online engine need --online; --online reads no 02 folder."""
    if args.online:
        if args.data is not None:
            raise PipelineError(f"--data {args.data}: --online computes the hidden states (pass --prepared)")
        for flag, value in (("--prefetch", args.prefetch), ("--batch-tokens", args.batch_tokens),
                            ("--max-samples", args.max_samples)):
            if value is not None and value < 1:
                raise PipelineError(f"{flag} {value}: must be at least 1")
        args.max_disk = parse_size(args.max_disk, "--max-disk") if args.max_disk is not None else 0
        fraction = args.gpu_memory_utilization
        if fraction is not None and (args.engine != "vllm" or args.vllm_url or not 0 < fraction < 1):
            raise PipelineError(f"--gpu-memory-utilization {fraction}: a share in (0, 1) of each GPU for "
                                "--engine vllm (a server by --vllm-url takes it at its start)")
        return
    given = [k for k in ONLINE_ONLY if getattr(args, k, None) is not None]
    given += ["engine"] if args.engine != "hf" else []
    given += ["tensor_parallel_size"] if args.tensor_parallel_size != 1 else []
    if given:
        raise PipelineError(f"--{given[0].replace('_', '-')} needs --online (04 reads 02's files otherwise)")


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
    config_file = read_config_file(args.draft_config or (TINY_CONFIG if args.target is None else KIMI_CONFIG))
    settings, overrides = TrainSettings.resolve(config_file, {k: getattr(args, k) for k in TRAINING_FLAGS},
                                                args.preset)
    for line in overrides:
        say(line)
    device = torch.device(default_device(None if distributed else args.device))  # torchrun: one GPU per rank
    patch.apply(trust_remote_code=trust_remote_code, compile_forward=device.type == "cuda" and not args.no_compile,
                loss=settings.loss, target_temperature=settings.target_temperature)
    output = Path(args.output or args.run_dir)
    data_dir, vocab_dir = stage_dir(args, "hidden_states", args.data), stage_dir(args, "vocab", args.vocab)

    # 2. inputs: target, vocabulary maps, hidden states (02's files, or the target computing them), each
    #    checked against the others
    info = load_target_info(target, trust_remote_code)
    vocab = load_vocab(vocab_dir, info.vocab_size)
    check_draft_fits(config_file.model, config_file.path, info, vocab.d2t.numel(), vocab_dir)
    with open_states(args, info, trust_remote_code, data_dir, output, rank, world_size) as data:
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
            try:
                trainer.run_training()
            except StateEngineError as e:
                raise PipelineError(f"{e}; {last_checkpoint_note(output / CHECKPOINTS)}") from e
        teardown_distributed()
        if not is_main:
            return 0

        # 6. export the best checkpoint by validation simulated acceptance length at the served k (the last
        #    without validation)
        epochs = numbered(output / CHECKPOINTS)
        records = read_log(output / LOG_FILE)
        best = best_validation(records, epochs, settings.served_k)
        chosen = best.epoch if best else epochs[-1]
        because = (f"best validation simulated acceptance length at k = {settings.served_k}" if best
                   else "last checkpoint (no validation pass: --val-ratio 0)")
        draft_dir = export_draft(output / CHECKPOINTS / str(chosen), config, output / DRAFT,
                                 {SPLIT_FILE: split_record(data, train_files, val_files, settings, output / DRAFT)})
        print(f"exported checkpoint {output / CHECKPOINTS / str(chosen)} ({because}"
              + (f": {best.acceptance_length:.3f} after epoch {best.epoch + 1})" if best else ")"))

        # 7. summary
        validation = last_validation(records, settings.served_k)
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
            best_validation=vars(best) if best else None, skipped_files=skips.skipped,
            online=data.summary() if args.online else None,
            state_wait_seconds={str(e + 1): w for e, w in trainer.state_waits.items()})
        report_path = report.save(output)
        print(f"trained epochs {start_epoch + 1}-{settings.epochs} of {settings.epochs} on {len(train_files):,} samples "
              f"({tokens:,} tokens per epoch, {report.tokens_per_second:,.0f} tok/s in the last epoch)"
              if report.epochs_run else f"nothing to train: all {settings.epochs} epochs have checkpoints")
        if skips.skipped:
            print(f"skipped {len(skips.skipped):,} of {len(data.files):,} {skips.what} that could not be used "
                  f"(listed in {report_path}; {skips.remedy})")
        if args.online:
            print(data.describe())
        print(f"outputs: {draft_dir} (draft), {output / CHECKPOINTS} ({len(epochs)} checkpoints), "
              f"{output / LOG_FILE}, {output / PLOT_FILE}, {report_path}")
        return 0



def open_states(args: argparse.Namespace, info: TargetInfo, trust_remote_code: bool, data_dir: Path, output: Path,
                rank: int, world_size: int) -> AbstractContextManager[HiddenStateData]:
    """Where the states come from: 02's folder, or (--online) the target's engine, open for the run."""
    if not args.online:
        return nullcontext(load_hidden_states(data_dir))
    runtime = Runtime.from_args(args)
    runtime.check_target(info)
    if runtime.vllm and not runtime.vllm_url and world_size > 1 and torch.cuda.is_available():
        raise PipelineError(f"--online --engine vllm under torchrun would start {world_size} engines on the same GPUs: "
                            "start one with scripts/serve_hidden_states.py and pass --vllm-url to share it")
    layer_ids = choose_layer_ids(args.layer_ids, info)
    return open_online_states(stage_dir(args, "prepared", args.prepared), data_dir, info, runtime, trust_remote_code,
                              layer_ids, STORAGES[args.storage or DEFAULT_STORAGE],
                              args.batch_tokens or DEFAULT_BATCH_TOKENS, args.prefetch or DEFAULT_PREFETCH,
                              args.max_disk, args.max_samples, output, rank, world_size,
                              args.gpu_memory_utilization)


if __name__ == "__main__":
    run_main(main)
