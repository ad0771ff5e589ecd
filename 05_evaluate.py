"""Step 05: measure a draft's real acceptance length with the target, and compare drafts.

Two kinds of figures, per draft:
- measured: real greedy speculative decoding (common/evaluate/decoding.py) on held-out prompts: the
  draft proposes --num-speculative-tokens tokens as a chain, the target verifies them in one
  pass. Acceptance length = tokens per verification pass, as vLLM and SGLang report it; the
  acceptance rate per draft position; and a check that every output equals plain greedy
  decoding of the target alone (what makes speculative decoding lossless).
- offline: validation loss, full and conditional accuracy per TTT step and the simulated
  acceptance length, computed as 04's validation pass does, over held-out hidden-state files.

Held-out: 04's validation split when its train_report.json sits next to the draft folder,
otherwise all of --data and the last prepared rows (see common/evaluate/measure.py).

Usage:
    python 05_evaluate.py                          # runs/default: draft/, hidden_states/, prepared/
    python 05_evaluate.py --draft RUN/draft --target DIR --prepared RUN/prepared [--data RUN/hidden_states] \
        [--reference OTHER_DRAFT] [--num-speculative-tokens 3] [--max-new-tokens 64] [--max-prompts 10] \
        [--json RUN/eval.json]
    python 05_evaluate.py --target /models/Kimi-K2.5 --trust-remote-code --run-dir RUN --device-map auto
        # the real target spread over all GPUs, the draft on the first
    python 05_evaluate.py ... --engine vllm [--vllm-python .venv-vllm/bin/python] [--tensor-parallel-size 8]
        # also serve the target with each draft in vLLM: its acceptance counters beside 05's own figures
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.cli import add_run_args, resolve_target, run_main, stage_dir
from common.data.prepared_dataset import check_prepared_target, load_prepared
from common.draft import patch
from common.draft.model import load_draft
from common.errors import PipelineError
from common.evaluate.decoding import SamplingParams
from common.evaluate.measure import (
    DraftReport,
    check_data,
    check_draft,
    check_prepared_of_split,
    gap_notes,
    held_out,
    measure_draft,
    measure_ngram,
    measure_plain,
    no_speculation,
    offline_metrics,
    select_prompts,
    summary_table,
    training_seq_len,
    untrained_draft,
    write_report,
)
from common.evaluate.served import engine_table, measure_with_vllm
from common.runtime import Runtime, add_runtime_args
from common.target.config import load_target_info
from common.target.model import load_text_model
from common.target.tokenizer import load_tokenizer
from common.train.data import load_hidden_states
from common.vllm.client import EngineSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    inputs = parser.add_argument_group("inputs and outputs")
    inputs.add_argument("--draft", type=Path, default=None, help="draft folder (default: RUN_DIR/draft)")
    inputs.add_argument("--reference", type=Path, default=None,
                        help="a second draft in speculators format to compare against, on the same samples")
    inputs.add_argument("--prepared", type=Path, default=None,
                        help="prepared dataset, the prompts' source (default: RUN_DIR/prepared)")
    inputs.add_argument("--data", type=Path, default=None,
                        help="hidden states for the offline metrics (default: RUN_DIR/hidden_states if present)")
    inputs.add_argument("--max-samples", type=int, default=None,
                        help="offline metrics over at most this many held-out files, the highest rows (default: all)")
    inputs.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    decoding = parser.add_argument_group("decoding")
    decoding.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                          help="draft tokens proposed per verification pass (default: %(default)s)")
    decoding.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default: %(default)s)")
    decoding.add_argument("--max-prompts", type=int, default=10, help="held-out prompts (default: %(default)s)")
    decoding.add_argument("--temperature", type=float, default=0.0,
                          help="0: greedy, checked identical to plain greedy decoding (default); > 0: speculative "
                               "sampling (Kimi-K2.5 is served at 1.0 thinking, 0.6 instant)")
    decoding.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling (default: %(default)s)")
    decoding.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    decoding.add_argument("--no-baselines", action="store_true",
                          help="skip the n-gram and untrained-draft baselines")
    decoding.add_argument("--offline-only", action="store_true", help="skip speculative decoding")
    add_runtime_args(parser, "also measure served acceptance")
    args = parser.parse_args(argv)
    if args.engine == "vllm" and args.offline_only:
        raise PipelineError("--engine vllm measures served acceptance; it cannot be combined with --offline-only")
    for flag in ("num_speculative_tokens", "max_new_tokens", "max_prompts", "max_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise PipelineError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if not 0.0 <= args.temperature <= 100.0:
        raise PipelineError(f"--temperature {args.temperature}: must be in [0, 100] (0 is greedy)")
    if not 0.0 < args.top_p <= 1.0:
        raise PipelineError(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.top_p < 1.0 and args.temperature == 0.0:
        raise PipelineError(f"--top-p {args.top_p} needs --temperature > 0 (greedy ignores it)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with patch.target_weights_read_once():  # the drafts built below share one read of the target's head
        return evaluate(args)


def evaluate(args: argparse.Namespace) -> int:
    k = args.num_speculative_tokens
    runtime = Runtime.from_args(args)
    device, dtype = runtime.primary_device, runtime.dtype

    # 1. the target, and every draft checked against it before anything heavy is loaded
    target, trust_remote_code = resolve_target(args)
    info = load_target_info(target, trust_remote_code)
    draft_dirs = {"draft": stage_dir(args, "draft", args.draft)}
    if args.reference is not None:
        draft_dirs["reference"] = args.reference
    for folder in draft_dirs.values():
        check_draft(folder, info)

    # 2. held-out samples: hidden states (optional unless named) and prompts
    data_dir = stage_dir(args, "hidden_states", args.data)
    data = load_hidden_states(data_dir) if args.data is not None or data_dir.is_dir() else None
    if data is None and args.offline_only:
        raise PipelineError(f"--offline-only: no hidden states at {data_dir} (run 02 or pass --data)")
    split = held_out(draft_dirs["draft"], data, args.max_samples)
    prepared_dir = stage_dir(args, "prepared", args.prepared)
    ds, prepared = load_prepared(prepared_dir)
    check_prepared_target(prepared, prepared_dir, info.path, info.vocab_size)
    check_prepared_of_split(draft_dirs["draft"], prepared_dir)
    prompts, skipped = select_prompts(ds, args.max_prompts, split.rows)
    print(f"target {info.path} ({info.text_architecture}, {info.num_layers} layers); k = {k}; held-out: {split.rule}")

    # 3. each draft loaded, and its offline metrics on the same files
    reports = []
    for name, folder in draft_dirs.items():
        draft = load_draft(folder, target=info.path, trust_remote_code=trust_remote_code, device=device)
        layer_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
        report = DraftReport(name=name, path=str(folder))
        if data is not None:
            try:
                check_data(data, info, layer_ids, folder)
            except PipelineError as e:  # the data is wrong for our draft; a reference may just differ
                if name == "draft":
                    raise
                print(f"offline metrics of {name} skipped: {e}")
            else:
                report.offline = offline_metrics(draft, data, split.files, k, training_seq_len(draft_dirs["draft"]),
                                                 device)
                if report.offline["skipped_files"]:
                    print(f"offline metrics of {name}: skipped {len(report.offline['skipped_files'])} of "
                          f"{len(split.files)} hidden-state files that could not be used")
        reports.append((report, draft))

    # 4. measured: plain decoding once, then speculative decoding with each draft and baseline
    sampling = SamplingParams(args.temperature, args.top_p)
    baselines: dict[str, DraftReport] = {}
    plain = None
    if not args.offline_only:
        context = max((len(p.ids) for p in prompts), default=0) + args.max_new_tokens + k + 1  # longest sequence
        model = load_text_model(info, dtype, runtime.device, runtime.device_map, runtime.max_memory, context,
                                logits=True)
        stop_ids = set(info.stop_ids)
        mode = "greedy" if sampling.greedy else f"sampling at temperature {args.temperature}, top-p {args.top_p}"
        print(f"decoding {len(prompts)} prompts (rows {prompts[0].row}..{prompts[-1].row}, {skipped} without a "
              f"prompt skipped), up to {args.max_new_tokens} new tokens each, {mode}, stop ids {sorted(stop_ids)}")
        run = dict(k=k, max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, sampling=sampling, seed=args.seed)
        plain = measure_plain(model, prompts, args.max_new_tokens, stop_ids, sampling, args.seed)
        for report, draft in reports:
            report.measured = measure_draft(model, draft.to(dtype), prompts, plain, desc=report.name, **run)
        if not args.no_baselines:
            baselines["ngram"] = DraftReport("n-gram", "prompt lookup, n 3..1",
                                             measure_ngram(model, prompts, plain, **run))
            untrained = untrained_draft(reports[0][1])
            baselines["untrained"] = DraftReport("untrained", "draft at its initial weights",
                                                 measure_draft(model, untrained, prompts, plain, desc="untrained",
                                                               **run))
        baselines["none"] = DraftReport("no speculation", "target alone", no_speculation(plain, k, sampling.greedy))

    # 5. served: vLLM with each draft and without speculation, on the same prompts
    served: dict = {}
    if runtime.vllm:
        longest = max(len(p.ids) for p in prompts) + args.max_new_tokens + k + 8
        # vLLM serves in --dtype, else its bf16, whatever 05's own decoder uses
        base = EngineSettings.for_target(info, longest, trust_remote_code, runtime.tensor_parallel_size,
                                         runtime.vllm_dtype)
        served_plain, served = measure_with_vllm(runtime.vllm_python, base, [(p.sample_id, p.ids) for p in prompts],
                                                 draft_dirs, k, args.max_new_tokens, set(info.stop_ids))

    # 6. summary: the side-by-side table, one output text, the JSON
    drafts = [report for report, _ in reports]
    print(summary_table(drafts + list(baselines.values()), k, plain))
    if served:
        print(engine_table([r.name for r in drafts], {r.name: r.measured for r in drafts}, served,
                           {r.name: (r.offline or {}).get("simulated_acceptance_length") for r in drafts}, k))
    tokenizer = load_tokenizer(target, trust_remote_code)
    decode = tokenizer.decode
    if drafts[0].measured is not None:
        first = drafts[0].measured.generations[0]
        print(f"output of {prompts[0].sample_id} ({len(first.tokens)} tokens): {decode(first.tokens)!r}")
        mismatched = [f"{r.name}: {', '.join(r.measured.mismatched)}" for r in drafts if r.measured.mismatched]
        if mismatched:
            print(f"NOT identical to greedy decoding: {'; '.join(mismatched)}")
        for line in gap_notes(drafts):
            print(line)
    if args.json is not None:
        settings = {"target": info.path, "num_speculative_tokens": k, "max_new_tokens": args.max_new_tokens,
                    "prompts": len(prompts), "held_out": split.rule, "dtype": str(dtype).removeprefix("torch."),
                    "engine": args.engine, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
        if served:
            settings["vllm_plain_tokens_per_second"] = served_plain.tokens_per_second
        write_report(args.json, drafts, prompts, decode, settings, baselines,
                     per_draft={name: {"vllm": m.figures()} for name, m in served.items()})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)
