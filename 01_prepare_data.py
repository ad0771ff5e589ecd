"""Step 01: conversations -> tokenized samples with loss masks (RUN/prepared/).

Each conversation is rendered with the target tokenizer's own chat template; the loss mask is 1
on what the target generates for each assistant turn after the generation prompt (reasoning,
`</think>`, content, tool calls, end-of-turn token). Reasoning of every turn is kept through the
template's own switch (Kimi: preserve_thinking=True). Inputs: JSONL, JSON, Parquet, a saved
Hugging Face dataset, or a folder of them; OpenAI (`messages`, `tools`, `tool_calls`, tool
results, list content) or ShareGPT (`conversations`, with function_call/observation turns) form.
Bad samples and malformed tool calls are skipped and counted by reason in prepare_report.json.
Interrupted (Ctrl-C, SIGTERM, SIGKILL), the same command run again resumes: what was read and every
finished chunk of `--chunk-size` conversations are kept next to the output until it is written.

Usage:
    python 01_prepare_data.py                      # every data/demo_*.jsonl, miniature Kimi-style target
    python 01_prepare_data.py --input data/ --target /models/Kimi-K2.5 --trust-remote-code \\
        --output runs/kimi/prepared --max-len 2048 --num-proc 16
    python 01_prepare_data.py --input chats.jsonl --max-samples 1000 --seed 0   # a random subset
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.cli import add_run_args, resolve_target, run_main, stage_dir
from common.defaults import demo_inputs
from common.prepare.prepare import CHUNK_SIZE, PrepareOptions, prepare, summary_lines, warning_lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_run_args(parser)
    data = parser.add_argument_group("data")
    data.add_argument("--input", type=Path, nargs="+", default=None,
                      help="conversation files or folders (default: every shipped data/demo_*.jsonl)")
    data.add_argument("--output", type=Path, default=None, help="prepared dataset folder (default: RUN_DIR/prepared)")
    data.add_argument("--max-samples", type=int, default=None,
                      help="keep a random subset of this many valid conversations (default: all)")
    data.add_argument("--seed", type=int, default=0, help="seed of the --max-samples subset (default: %(default)s)")
    tokens = parser.add_argument_group("tokenization")
    tokens.add_argument("--max-len", type=int, default=2048,
                        help="truncate samples to this many tokens (default: %(default)s)")
    tokens.add_argument("--num-proc", type=int, default=1,
                        help="tokenizer worker processes (default: %(default)s)")
    tokens.add_argument("--chunk-size", type=int, default=CHUNK_SIZE,
                        help="conversations tokenized per chunk, the unit of resume: an interrupted run, run "
                             "again, keeps its finished chunks (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    # 1. resolve the target, the inputs and the output folder
    target, trust_remote_code = resolve_target(args)
    options = PrepareOptions(
        inputs=args.input or demo_inputs(), target=target, output=stage_dir(args, "prepared", args.output),
        max_len=args.max_len, max_samples=args.max_samples, seed=args.seed, num_proc=args.num_proc,
        trust_remote_code=trust_remote_code, chunk_size=args.chunk_size)
    print(f"target {target}, inputs {', '.join(map(str, options.inputs))}, max length {options.max_len:,}")

    # 2. read, tokenize, mask, truncate and write the prepared folder
    report = prepare(options)

    # 3. summary: one warning line per drop reason, then the counts
    for line in warning_lines(report):
        print(line, file=sys.stderr)
    for line in summary_lines(report, options.output):
        print(line)
    return 0


if __name__ == "__main__":
    run_main(main)
