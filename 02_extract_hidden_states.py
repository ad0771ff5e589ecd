"""Step 02: run the target over the prepared samples and keep the hidden states EAGLE-3 trains on.

For every prepared row i it writes `data_{i}.pt` in speculators' v1 format: the input ids, the
loss mask, three auxiliary layers (default [2, N//2, N-3], vLLM's layer-id convention) and the
post-norm final state, in bf16 (default) or, with `--storage fp8`, in float8 e4m3 with one
scale per token row (half the disk; common/hidden_states/storage.py), plus `sample_lengths.json` and
`data_config.json` (see common/hidden_states/data_config.py). Only those four states are captured, with forward hooks on the base
model; samples of similar length run in batches under a padded-token budget.

Usage:
    python 02_extract_hidden_states.py                        # runs/default/prepared -> runs/default/hidden_states
    python 02_extract_hidden_states.py --prepared RUN/prepared --target DIR --output RUN/hidden_states \
        [--layer-ids 2 30 58] [--batch-tokens 8192] [--max-samples N] [--dtype bf16] [--storage fp8]
    python 02_extract_hidden_states.py ... --target /models/Kimi-K2.5 --trust-remote-code --device-map auto
        # one large target spread over all GPUs of the host
    torchrun --nproc-per-node 8 02_extract_hidden_states.py --prepared ... --target ... --output ...
        # data parallel, one shard per GPU (RANK / WORLD_SIZE give --shard-index / --num-shards)
    python 02_extract_hidden_states.py ... --num-shards 4 --shard-index J   # shard J of 4, e.g. on host J
    python 02_extract_hidden_states.py ... --engine vllm [--vllm-python .venv-vllm/bin/python] \
        [--tensor-parallel-size 8]                       # vLLM from its own environment (common/vllm/client.py)

Progress goes to the experiment trackers of `--report-to` (default: TensorBoard when installed, into
RUN/tensorboard/extract/, RUN being the folder that holds the output; common/trackers.py): the settings
once, then tokens/s, samples written and failed, bytes written and the forward pass's share of the time
at step = samples of the shard done (common/extract/run.py). Under --num-shards each shard is its own
tracker run (stage extract-shard-J-of-K, a --run-name given gets the same suffix).

Run the same command again to resume: complete files are kept, unreadable ones redone (files the
journal extract_journal_J_of_K.txt lists with their size and ids are kept unopened). Add
`--verify` to re-read every finished file and redo those whose bytes no longer have the digest
the journal recorded when they were written (a file damaged in place keeps its size). Shards
may share one output folder; the last one to finish writes sample_lengths.json/data_config.json.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

from common.atomic import format_bytes
from common.cli import add_data_args, resolve_target, run_main, stage_dir, stage_parser
from common.engine_device import Runtime, add_runtime_args
from common.errors import PipelineError
from common.extract.batches import (
    DEFAULT_BATCH_TOKENS,
    check_token_ids,
    estimate_bytes,
    plan_batches,
    shard_batches,
)
from common.extract.engines import open_state_engine
from common.extract.run import ExtractionRun, ExtractStats
from common.hidden_states.data_config import NUM_STATES, DataConfig, new_data_config
from common.hidden_states.folder_lock import check_disk, shard_lock
from common.hidden_states.journal import Journal, find_done, journal_path
from common.hidden_states.manifests import (
    check_output_folder,
    manifest_path,
    merge_manifests,
    remove_stale_rows,
    write_manifest,
)
from common.hidden_states.state_files import remove_own_temporaries
from common.hidden_states.storage import DEFAULT_STORAGE, STORAGES
from common.prepare.prepared_dataset import check_prepared_target, load_prepared
from common.target.config import choose_layer_ids, load_target_info, weight_map
from common.trackers import add_report_args, reporting


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = stage_parser(__doc__)
    data = add_data_args(parser, "hidden_states")
    data.add_argument("--max-samples", type=int, default=None, help="only the first N prepared rows")
    data.add_argument("--storage", choices=sorted(STORAGES), default=DEFAULT_STORAGE,
                      help="hidden states on disk: bf16, or fp8 (e4m3, one bf16 scale per token row: about half "
                           "the bytes; 04 and 05 read both) (default: %(default)s)")
    model = parser.add_argument_group("model")
    model.add_argument("--layer-ids", type=int, nargs="+", default=None, metavar="I",
                       help="three auxiliary layer ids, vLLM convention (default: 2 N//2 N-3)")
    batching = parser.add_argument_group("batching and sharding")
    batching.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                          help="padded tokens per forward pass (default: %(default)s)")
    batching.add_argument("--num-shards", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                          help="processes splitting the samples (default: $WORLD_SIZE or 1)")
    batching.add_argument("--shard-index", type=int, default=int(os.environ.get("RANK", 0)),
                          help="this process's shard, 0-based (default: $RANK or 0)")
    batching.add_argument("--skip-disk-check", action="store_true",
                          help="start even when the output disk looks too small")
    batching.add_argument("--verify", action="store_true",
                          help="re-read every finished file and redo those whose bytes differ from the digest "
                               "recorded when they were written (a plain restart only checks sizes)")
    add_runtime_args(parser, "extract")
    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.batch_tokens <= 0:
        raise PipelineError(f"--batch-tokens {args.batch_tokens}: must be positive")
    if args.max_samples is not None and args.max_samples <= 0:
        raise PipelineError(f"--max-samples {args.max_samples}: must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prepared_dir = stage_dir(args, "prepared", args.prepared)
    out = stage_dir(args, "hidden_states", args.output)

    # 1. The target's config and the layers to keep (no weights read yet).
    target, trust_remote_code = resolve_target(args)
    info = load_target_info(target, trust_remote_code)
    weight_map(info.path)  # a folder without weights is refused before the output folder is touched
    layer_ids = choose_layer_ids(args.layer_ids, info)
    runtime = Runtime.from_args(args)
    runtime.check_target(info)  # what vLLM cannot run here is refused now, not after its engine's start

    # 2. The prepared samples, refused if their ids do not fit the target's vocabulary.
    ds, report = load_prepared(prepared_dir)
    num_rows = min(len(ds), args.max_samples or len(ds))
    lengths = dict(enumerate(check_token_ids(ds, num_rows, info.vocab_size)))

    # 3. The output folder (refused if it holds another target's states), this shard's batches, resume.
    storage = STORAGES[args.storage]
    config = new_data_config(info, layer_ids, runtime.compute_dtype, prepared_dir, report, storage)
    check_output_folder(out, config)
    check_prepared_target(report, prepared_dir, info.path, info.vocab_size)
    batches = shard_batches(plan_batches(lengths, args.batch_tokens), args.num_shards, args.shard_index)
    mine = {i for batch in batches for i in batch}
    manifest = manifest_path(out, args.shard_index, args.num_shards)
    out.mkdir(parents=True, exist_ok=True)
    with shard_lock(out, args.shard_index, args.num_shards):  # a second 02 on this shard is refused
        remove_own_temporaries(out, mine, manifest)
        stale = remove_stale_rows(out, config, num_rows)
        if stale:
            print(f"{out} was written from another prepared dataset: removed {stale:,} files of rows past its end")
        done, redo = find_done(out, ds, mine, info.hidden_size, storage=storage, verify=args.verify)
        todo_tokens = sum(lengths[i] for i in mine - done)

        # 4. Disk: refuse to start a run that cannot finish.
        needed = estimate_bytes(todo_tokens, len(mine - done), info.hidden_size, storage)
        if not args.skip_disk_check:
            check_disk(out, needed)
        shard = f"shard {args.shard_index} of {args.num_shards}: " if args.num_shards > 1 else ""
        print(f"{shard}{len(mine):,} samples in {len(batches):,} batches: {len(done):,} done, {redo:,} to redo, "
              f"{len(mine - done):,} to extract ({todo_tokens:,} tokens, about {format_bytes(needed)})")
        print(f"target {info.path} ({info.architecture}, {info.num_layers} layers, hidden {info.hidden_size}); "
              f"states {layer_ids} + post-norm final; compute on {runtime.describe()}, stored as {storage.name}")

        # 5. Extract.
        write_manifest(manifest, config, {i: lengths[i] for i in done}, [], finished=False)
        stats = ExtractStats()
        if mine - done:
            show = os.environ.get("LOCAL_RANK", "0") == "0"  # one bar per host under torchrun
            shard_suffix = f"-shard-{args.shard_index}-of-{args.num_shards}" if args.num_shards > 1 else ""
            stage = f"extract{shard_suffix}"  # each shard a tracker run of its own, its --run-name too
            args.run_name = args.run_name and f"{args.run_name}{shard_suffix}"
            # Steps are samples done, so a resumed run counts on from the files it found (and drops
            # what a killed run logged past them).
            with reporting(args, out.parent, stage, start_step=len(done)) as trackers, \
                    Journal(journal_path(out, args.shard_index, args.num_shards)) as journal, \
                    open_state_engine(runtime, info, trust_remote_code, layer_ids, storage, out, max(lengths.values()),
                                      args.batch_tokens, (args.shard_index, args.num_shards)) as extractor:
                trackers.log_params(run_params(args, config, runtime, len(mine), len(done), todo_tokens))
                run = ExtractionRun(extractor, ds, out, show_progress=show, journal=journal, trackers=trackers)
                stats = run.run(batches, done, lengths)

        # 6. This shard's manifest; the last shard to finish merges them all.
        write_manifest(manifest, config, {i: lengths[i] for i in done} | stats.written, stats.failed, finished=True)
        merged = merge_manifests(out, args.num_shards)

        if stats.written:
            tokens = stats.tokens
            print(f"{shard}extracted {len(stats.written):,} samples ({tokens:,} tokens) in {stats.seconds:,.1f}s: "
                  f"{tokens / stats.seconds:,.0f} tokens/s, forward pass {stats.forward_seconds / stats.seconds:.0%} "
                  "of the time")
            print(f"hidden states {stats.state_bytes / tokens:,.0f} B/token ({storage.name}: "
                  f"{storage.bytes_per_token(NUM_STATES, info.hidden_size):,} = {NUM_STATES} x {info.hidden_size} x "
                  f"{storage.dtype.itemsize}{' + scales' if storage.scaled else ''}), "
                  f"files {stats.file_bytes / tokens:,.0f} B/token, {stats.file_bytes / 1e6:,.1f} MB written")
        print(f"{shard}kept {len(done):,} existing, extracted {len(stats.written):,}, failed {len(stats.failed):,}"
              + "".join(f"\n  failed {f['sample_id']} (row {f['index']}): {f['error']}" for f in stats.failed[:10]))
        if merged:
            print(f"output: {out} ({merged.sample_count:,} samples, {merged.token_count:,} tokens, "
                  f"{merged.bytes_total / 1e6:,.1f} MB; data_config.json, sample_lengths.json)")
        else:
            print(f"output: {out} (sample_lengths.json and data_config.json follow when the last shard finishes)")
        return 0


def run_params(args: argparse.Namespace, config: DataConfig, runtime: Runtime, samples: int, found_done: int,
               todo_tokens: int) -> dict:
    """The hyper-parameters the trackers get once: data_config.json's identity of the run (target,
    layer ids, storage, prepared fingerprint, ...) and this shard's batching, engine and counts."""
    identity = {k: v for k, v in asdict(config).items()
                if k not in ("failed", "sample_count", "token_count", "bytes_total", "num_shards")}
    return {**identity, "batch_tokens": args.batch_tokens, "max_samples": args.max_samples,
            "num_shards": args.num_shards, "shard_index": args.shard_index, "engine": runtime.engine,
            "runtime": runtime.describe(), "shard_samples": samples, "found_done": found_done,
            "todo_tokens": todo_tokens, "verify": args.verify}


if __name__ == "__main__":
    run_main(main)
