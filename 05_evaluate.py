"""Step 05: measure a draft's real acceptance length with the target, and compare drafts.

Two kinds of figures, per draft:
- measured: real speculative decoding (common/evaluate/decoding.py): the draft proposes k tokens
  (--num-speculative-tokens, one or several k, each measured on the same prompts) as a chain, the
  target verifies them in one pass. Acceptance length = tokens per verification pass, as vLLM and
  SGLang report it; the acceptance rate per draft position; and a check that every output equals
  plain greedy decoding of the target alone (what makes speculative decoding lossless). Prompts:
  04's held-out rows, or published prompt sets (--prompts mt-bench, humaneval, or a file: MT-Bench,
  HumanEval, GSM8K or chat rows) rendered with the target's chat template, per set and category.
- offline: validation loss, full and conditional accuracy per TTT step and the simulated
  acceptance length, computed as 04's validation pass does, over held-out hidden-state files.

Held-out: 04's validation split when its train_report.json sits next to the draft folder,
otherwise all of --data and the last prepared rows (see common/evaluate/measure.py).

The figures also go to the experiment trackers of `--report-to` (default: TensorBoard when installed,
into RUN_DIR/tensorboard/evaluate/, beside 04's RUN_DIR/tensorboard/train/; common/trackers.py) at
step = k: per prompt set the measured acceptance length and rate per position, the simulated
one, the baselines', and vLLM's served figures (tags: common/evaluate/report.py's tracker_scalars).
An evaluation run again in the same run folder replaces the earlier one's curves in TensorBoard.

Usage:
    python 05_evaluate.py                          # runs/default: draft/, hidden_states/, prepared/
    python 05_evaluate.py --draft RUN/draft --target DIR --prepared RUN/prepared [--data RUN/hidden_states] \
        [--reference OTHER_DRAFT] [--num-speculative-tokens 3] [--max-new-tokens 64] [--max-prompts 10] \
        [--json RUN/eval.json]
    python scripts/fetch_prompt_sets.py            # once: MT-Bench and HumanEval into data/prompt_sets/
    python 05_evaluate.py --prompts mt-bench --prompts humaneval --num-speculative-tokens 3 5 8 \
        --thinking off --max-prompts 80            # as the published tables measure (instant mode, T 0.6)
    python 05_evaluate.py --target /models/Kimi-K2.5 --trust-remote-code --run-dir RUN --device-map auto
        # the real target spread over all GPUs, the draft on the first
    python 05_evaluate.py ... --engine vllm [--vllm-python .venv-vllm/bin/python] [--tensor-parallel-size 8]
        # also serve the target with each draft in vLLM: its acceptance counters beside 05's own figures
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.cli import add_run_args, resolve_target, run_main, stage_dir
from common.draft import patch
from common.draft.model import load_draft
from common.engine_device import Runtime, add_runtime_args
from common.errors import PipelineError
from common.evaluate.decoding import DRAFT_SAMPLING, SamplingParams
from common.evaluate.measure import (
    BASELINES,
    HeldOut,
    check_draft,
    check_prepared_of_split,
    fitting_offline_metrics,
    held_out,
    measure_each_k,
    measure_plain,
    measure_plain_turns,
    no_speculation,
    training_seq_len,
)
from common.evaluate.prompt_sets import PROMPT_FORMATS, PUBLISHED_SETS, read_prompt_sets
from common.evaluate.prompts import (
    HELD_OUT,
    ChatPrompter,
    Prompt,
    decoding_mode,
    describe_prompts,
    longest_conversation,
    select_prompts,
)
from common.evaluate.report import (
    DraftReport,
    output_lines,
    served_scalars,
    summary_table,
    tracker_scalars,
    write_report,
)
from common.evaluate.served import measure_with_vllm, served_lines
from common.hidden_states.loader import load_hidden_states
from common.prepare.prepared_dataset import check_prepared_target, load_prepared
from common.target.config import TargetInfo, load_target_info
from common.target.model import load_text_model
from common.target.tokenizer import load_tokenizer
from common.trackers import Trackers, add_report_args, reporting
from common.vllm.client import EngineSettings, check_sampled_speculation, vllm_device

MODES = {"on": True, "off": False}
STAGE = "evaluate"  # the trackers' stage: RUN_DIR/tensorboard/evaluate/


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    inputs = parser.add_argument_group("inputs and outputs")
    inputs.add_argument("--draft", type=Path, default=None, help="draft folder (default: RUN_DIR/draft)")
    inputs.add_argument("--reference", type=Path, default=None,
                        help="a second draft in speculators format to compare against, on the same samples")
    inputs.add_argument("--prepared", type=Path, default=None,
                        help="prepared dataset, the prompts' source without --prompts (default: RUN_DIR/prepared)")
    inputs.add_argument("--prompts", action="append", default=None, metavar="SET",
                        help=f"a prompt set instead of the held-out rows (repeatable): {' or '.join(PUBLISHED_SETS)} "
                             "(fetched by scripts/fetch_prompt_sets.py) or a .jsonl/.jsonl.gz/.parquet file")
    inputs.add_argument("--prompts-format", choices=list(PROMPT_FORMATS), default=None,
                        help="the prompt files' format (default: detected from the fields of their first row)")
    inputs.add_argument("--data", type=Path, default=None,
                        help="hidden states for the offline metrics (default: RUN_DIR/hidden_states if present)")
    inputs.add_argument("--max-samples", type=int, default=None,
                        help="offline metrics over at most this many held-out files, the highest rows (default: all)")
    inputs.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    decoding = parser.add_argument_group("decoding")
    decoding.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[3], metavar="K",
                          help="draft tokens proposed per verification pass; several: each measured on the same "
                               "prompts (default: %(default)s)")
    decoding.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default: %(default)s)")
    decoding.add_argument("--max-prompts", type=int, default=10,
                          help="held-out prompts, or the first items of each prompt set (default: %(default)s)")
    decoding.add_argument("--thinking", choices=list(MODES), default=None,
                          help="with --prompts, for templates with a thinking switch (Kimi-K2.5): the generation "
                               "prompt opens a think block (on) or an empty one (off); default temperature 1.0 "
                               "(on) or 0.6 (off), Kimi-K2.5's serving values (default: the template's own, greedy)")
    decoding.add_argument("--temperature", type=float, default=None,
                          help="0: greedy, checked identical to plain greedy decoding (default without --thinking);"
                               " > 0: speculative sampling")
    decoding.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling (default: %(default)s)")
    decoding.add_argument("--draft-sampling", choices=DRAFT_SAMPLING, default="greedy",
                          help="when sampling, how a draft proposes (vLLM's draft_sample_method, passed to it with "
                               "--engine vllm): 'greedy' its argmax, accepted with the target's probability of it "
                               "(vLLM's default), or 'probabilistic' sampled from its own distribution q, accepted "
                               "with min(1, p/q) (default: %(default)s)")
    decoding.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    decoding.add_argument("--no-baselines", action="store_true",
                          help="skip the n-gram and untrained-draft baselines")
    decoding.add_argument("--offline-only", action="store_true", help="skip speculative decoding")
    add_runtime_args(parser, "also measure served acceptance")
    add_report_args(parser)
    args = parser.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Flag combinations and values, refused naming the flag."""
    if args.engine == "vllm" and args.offline_only:
        raise PipelineError("--engine vllm measures served acceptance; it cannot be combined with --offline-only")
    if args.offline_only and args.prompts:
        raise PipelineError("--prompts sets are decoded; they cannot be combined with --offline-only")
    if args.thinking is not None and not args.prompts:
        raise PipelineError(f"--thinking {args.thinking} renders --prompts sets; the held-out prompts were rendered "
                            "by 01 (pass --prompts)")
    if len(set(args.num_speculative_tokens)) != len(args.num_speculative_tokens):
        raise PipelineError(f"--num-speculative-tokens {args.num_speculative_tokens}: a k is given twice")
    for flag in ("max_new_tokens", "max_prompts", "max_samples"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise PipelineError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if min(args.num_speculative_tokens) < 1:
        raise PipelineError(f"--num-speculative-tokens {min(args.num_speculative_tokens)}: must be at least 1")
    if args.temperature is not None and not 0.0 <= args.temperature <= 100.0:
        raise PipelineError(f"--temperature {args.temperature}: must be in [0, 100] (0 is greedy)")
    if not 0.0 < args.top_p <= 1.0:
        raise PipelineError(f"--top-p {args.top_p}: must be in (0, 1]")
    greedy = args.temperature == 0.0 or (args.temperature is None and args.thinking is None)
    if args.top_p < 1.0 and greedy:
        raise PipelineError(f"--top-p {args.top_p} needs --temperature > 0 (greedy ignores it)")
    if args.draft_sampling != "greedy" and greedy:
        raise PipelineError(f"--draft-sampling {args.draft_sampling} needs --temperature > 0 (greedy decoding "
                            "proposes the draft's argmax)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with patch.target_weights_read_once():  # the drafts built below share one read of the target's head
        return evaluate(args)


def evaluate(args: argparse.Namespace) -> int:
    ks = args.num_speculative_tokens
    runtime = Runtime.from_args(args)
    device, dtype = runtime.primary_device, runtime.dtype

    # 1. the target, and every draft and prompt file checked against it before anything heavy is loaded
    target, trust_remote_code = resolve_target(args)
    info = load_target_info(target, trust_remote_code)
    tokenizer = load_tokenizer(target, trust_remote_code)
    draft_dirs = {"draft": stage_dir(args, "draft", args.draft)}
    if args.reference is not None:
        draft_dirs["reference"] = args.reference
    for folder in draft_dirs.values():
        check_draft(folder, info)
    sets = read_prompt_sets(args.prompts, args.prompts_format, args.max_prompts) if args.prompts else None
    thinking, temperature = decoding_mode(tokenizer, MODES.get(args.thinking), args.temperature)
    sampling = SamplingParams(temperature, args.top_p, args.draft_sampling)
    if runtime.vllm:
        check_sampled_speculation(vllm_device(), temperature)

    # 2. held-out samples: hidden states (optional unless named) and, without --prompts, prompts
    data_dir = stage_dir(args, "hidden_states", args.data)
    data = load_hidden_states(data_dir) if args.data is not None or data_dir.is_dir() else None
    if data is None and args.offline_only:
        raise PipelineError(f"--offline-only: no hidden states at {data_dir} (run 02 or pass --data)")
    if data is None:
        print(f"offline metrics skipped: no hidden states at {data_dir} (04 --online keeps none unless --max-disk; "
              "02 writes them); the acceptance length is measured by decoding")
    split = held_out(draft_dirs["draft"], data, args.max_samples)
    prompts, skipped = held_out_prompts(args, info, split) if sets is None else ([], 0)
    print(f"target {info.path} ({info.text_architecture}, {info.num_layers} layers); k = {', '.join(map(str, ks))}; "
          f"held-out: {split.rule}")

    # 3. each draft loaded, and its offline metrics on the same files (at the largest k's TTT steps)
    drafts = {name: load_draft(folder, target=info.path, trust_remote_code=trust_remote_code, device=device)
              for name, folder in draft_dirs.items()}
    seq_len = training_seq_len(draft_dirs["draft"])
    reports = [DraftReport(name, str(folder), offline=fitting_offline_metrics(
        name, drafts[name], folder, info, data, split.files, max(ks), seq_len, device))
        for name, folder in draft_dirs.items()]

    # 4. measured: plain decoding once (turn by turn on prompt sets), then speculative decoding with
    #    each draft and baseline at each k
    baselines: dict[str, DraftReport] = {}
    plain, model = None, None
    if not args.offline_only:
        prompter = ChatPrompter(tokenizer, thinking)
        longest = longest_conversation(sets, prompter) if sets else max(len(p.ids) for p in prompts)
        turns = 1 if sets is None else max(len(i.turns) for items in sets.values() for i in items)
        model = load_text_model(info, dtype, runtime.device, runtime.device_map, runtime.max_memory,
                                longest + turns * (args.max_new_tokens + max(ks) + 1), logits=True)
        stop_ids = set(info.stop_ids)
        mode = "greedy" if sampling.greedy else (f"sampling at temperature {temperature}, top-p {args.top_p}, "
                                                 f"drafts proposed {args.draft_sampling}")
        print(f"decoding {describe_prompts(sets, prompts, skipped, thinking)}, up to {args.max_new_tokens} new "
              f"tokens each, {mode}, stop ids {sorted(stop_ids)}")
        if sets is None:
            plain = measure_plain(model, prompts, args.max_new_tokens, stop_ids, sampling, args.seed)
        else:
            prompts, plain = measure_plain_turns(model, sets, prompter, args.max_new_tokens, stop_ids, sampling,
                                                 args.seed)
        measured = measure_each_k(model, {name: d.to(dtype) for name, d in drafts.items()}, prompts, plain, ks,
                                  args.max_new_tokens, stop_ids, sampling, args.seed, not args.no_baselines)
        for report in reports:
            report.by_k = measured[report.name]
        baselines = {key: DraftReport(name, what, measured[key]) for key, (name, what) in BASELINES.items()
                     if key in measured}
        baselines["none"] = DraftReport("no speculation", "target alone",
                                        {ks[0]: no_speculation(plain, ks[0], sampling.greedy)})

    # 5. 05's own figures: the side-by-side table, one output text, the JSON (before any engine starts)
    print(summary_table(reports + list(baselines.values()), ks, plain, prompts))
    for line in output_lines(reports, prompts, tokenizer.decode):
        print(line)
    settings = {"target": info.path, "num_speculative_tokens": ks[0], "num_speculative_tokens_measured": ks,
                "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "prompt_sets": list(sets or [HELD_OUT]),
                "held_out": split.rule, "dtype": str(dtype).removeprefix("torch."), "engine": args.engine,
                "thinking": args.thinking, "temperature": temperature,
                "top_p": args.top_p, "draft_sampling": None if sampling.greedy else args.draft_sampling,
                "seed": args.seed}
    if args.json is not None:
        write_report(args.json, reports, prompts, tokenizer.decode, settings, baselines, ks=ks)
        print(f"wrote {args.json}")
    # Step = k; start_step 0: TensorBoard drops an earlier evaluation's points of this run folder.
    scalars = tracker_scalars(reports, baselines, prompts, ks)
    with reporting(args, args.run_dir, STAGE, start_step=0) as trackers:
        trackers.log_params({**settings, "drafts": {name: str(folder) for name, folder in draft_dirs.items()}})
        try:
            # 6. served: vLLM with each draft at each k and without speculation, on the same prompts
            if runtime.vllm:
                longest = max(len(p.ids) for p in prompts) + args.max_new_tokens + max(ks) + 8
                # vLLM serves in --dtype, else its bf16, whatever 05's own decoder uses
                base = EngineSettings.for_target(info, longest, trust_remote_code, runtime.tensor_parallel_size,
                                                 runtime.vllm_dtype)
                served_plain, served = measure_with_vllm(runtime.vllm_python, base, prompts, draft_dirs, ks,
                                                         args.max_new_tokens, set(info.stop_ids), model, sampling,
                                                         args.seed)
                for line in served_lines(reports, served, ks):
                    print(line)
                for k, figures in served_scalars(served, served_plain.tokens_per_second).items():
                    scalars.setdefault(k, {}).update(figures)
                if args.json is not None:
                    settings["vllm_plain_tokens_per_second"] = served_plain.tokens_per_second
                    write_report(args.json, reports, prompts, tokenizer.decode, settings, baselines, ks=ks,
                                 per_draft={name: {k: {"vllm": m.figures()} for k, m in by_k.items()}
                                            for name, by_k in served.items()})
                    print(f"wrote {args.json} (with vLLM's figures)")
        finally:  # 05's own figures even when serving fails; each k once, served beside (W&B takes a step once)
            log_at_each_k(trackers, scalars)
    return 0


def log_at_each_k(trackers: Trackers, by_k: dict[int, dict[str, float | None]]) -> None:
    """Scalars of each k at step = k (TensorBoard draws each figure against k)."""
    for k, scalars in sorted(by_k.items()):
        trackers.log(scalars, k)


def held_out_prompts(args: argparse.Namespace, info: TargetInfo, split: HeldOut) -> tuple[list[Prompt], int]:
    """The prompts of 04's held-out prepared rows (and how many rows had none)."""
    prepared_dir = stage_dir(args, "prepared", args.prepared)
    ds, prepared = load_prepared(prepared_dir)
    check_prepared_target(prepared, prepared_dir, info.path, info.vocab_size)
    check_prepared_of_split(stage_dir(args, "draft", args.draft), prepared_dir)  # its held-out rows are this data's
    return select_prompts(ds, args.max_prompts, split.rows)


if __name__ == "__main__":
    run_main(main)
