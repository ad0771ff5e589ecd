"""Benchmark of step 01 on long multi-turn conversations: the whole stage against the tokenizer's
own encode of the same rendered texts, for the Kimi-style and the flat miniature target.

    python bench/bench_01_prepare.py [--conversations 300] [--turns 3 10] [--tool-share 0.25]
                                     [--repeats 5] [--num-proc 1 2] [--input FILE] [--max-len 2048]

Conversations: `--input` (a JSONL file), or generated from the shipped demo files' text (see
`generate`: long messages, as in ShareGPT-style data, and a `--tool-share` of tool-call
exchanges). Per target, `--num-proc` N and repeat it times
- 01: `prepare()` in this process on all conversations, minus `prepare()` on the first N alone
  (start-up cancelled: loading the tokenizer, building the masker, starting the workers), over the
  tokens of the rest (their full renderings, before the `--max-len` cut);
- the tokenizer's own encode, one text at a time in this process, of the same rendered texts, just
  before and just after the stage's two runs (their mean):
  Kimi's `tokenizer.encode(text)` (tiktoken, special tokens allowed), the fast tokenizer's
  `backend_tokenizer.encode(text, add_special_tokens=False)`;
and prints conversations/s and tokens/s of both and the ratio of 01's tokens/s over the encode's,
per repeat and their median, by the wall clock and, for one process, by its CPU time (what the run
itself cost on a shared machine; the goal, >= 0.3, is checked on it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the stage's bars would interleave with the table

from common.defaults import demo_inputs
from common.miniatures.targets import ensure_targets
from common.prepare.conversations import to_conversation
from common.prepare.loss_mask import ChatMasker
from common.prepare.prepare import PrepareOptions, prepare
from common.prepare.readers import iter_records, resolve_inputs
from common.target.tokenizer import load_tokenizer

GOAL = 0.3
KINDS = ("kimi", "flat")


def generate(out: Path, conversations: int, turns: tuple[int, int], tool_share: float, seed: int = 0) -> Path:
    """Write `conversations` long conversations built from the demo files' text: a system prompt, then
    `turns` exchanges, each a user message of 1-3 demo questions and an answer of 3-8 demo answers
    (with their reasoning), in ShareGPT-like proportions (a few hundred tokens a message); a
    `tool_share` of the exchanges is a demo tool-call exchange instead (call, result, answer), its
    tool declared."""
    rng = random.Random(seed)
    records = [json.loads(line) for path in demo_inputs() for line in path.read_text(encoding="utf-8").splitlines()]
    messages = [m for r in records for m in r["messages"]]
    systems = [m["content"] for m in messages if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    answers = [m for m in messages if m["role"] == "assistant" and m.get("content") and not m.get("tool_calls")]
    tool_exchanges = [(r["messages"][i:j], r["tools"]) for r in records if r.get("tools")
                      for i, j in _tool_exchanges(r["messages"])]
    with out.open("w", encoding="utf-8") as f:
        for n in range(conversations):
            convo, tools = [{"role": "system", "content": rng.choice(systems)}], {}
            for _ in range(rng.randint(*turns)):
                if rng.random() < tool_share:
                    exchange, declared = rng.choice(tool_exchanges)
                    convo += exchange
                    tools.update((t["function"]["name"], t) for t in declared)
                    continue
                parts = rng.sample(answers, rng.randint(3, 8))
                reasoning = [p["reasoning_content"] for p in parts if p.get("reasoning_content")]
                convo += [{"role": "user", "content": "\n\n".join(rng.sample(users, rng.randint(1, 3)))},
                          {"role": "assistant", "content": "\n\n".join(p["content"] for p in parts),
                           **({"reasoning_content": " ".join(reasoning)} if reasoning else {})}]
            record = {"id": f"long-{n}", "messages": convo, **({"tools": list(tools.values())} if tools else {})}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return out


def _tool_exchanges(messages: list[dict]) -> list[tuple[int, int]]:
    """(start, end) of each user turn whose answer goes through a tool call, up to the next user turn."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"] + [len(messages)]
    return [(a, b) for a, b in zip(starts, starts[1:]) if any(m.get("tool_calls") for m in messages[a:b])]


def rendered_texts(path: Path, masker: ChatMasker) -> list[str]:
    texts = []
    for sample_id, record in iter_records(resolve_inputs([path])):
        c = to_conversation(sample_id, record)
        texts.append(masker.render(c.messages, c.tools).text)
    return texts


def own_encode(tokenizer):
    """The tokenizer's own fastest call on one text."""
    if tokenizer.is_fast:
        return lambda text: tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode


def time_encode(encode, texts: list[str]) -> tuple[float, float]:
    start = clocks()
    for t in texts:
        encode(t)
    return since(start)


def clocks() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on a shared machine the CPU time of a one-process
    run is what the run itself cost, the wall time also what the neighbours took."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    now = clocks()
    return now[0] - start[0], now[1] - start[1]


def time_prepare(target: Path, inputs: Path, work: Path, max_len: int, num_proc: int) -> tuple[float, float]:
    out = Path(tempfile.mkdtemp(dir=work)) / "prepared"
    start = clocks()
    prepare(PrepareOptions(inputs=[inputs], target=target, output=out, max_len=max_len, num_proc=num_proc,
                           trust_remote_code=True))
    return since(start)


def bench_target(kind: str, target: Path, inputs: Path, work: Path, args) -> dict:
    """Per `--num-proc` N: (conversations, tokens, [(01 seconds, encode seconds) per repeat]); the
    first N conversations are the start-up run's (one each, so that every worker starts)."""
    tokenizer = load_tokenizer(target, trust_remote_code=True)
    texts = rendered_texts(inputs, ChatMasker(tokenizer))
    encode = own_encode(tokenizer)
    lengths = [len(encode(t)) for t in texts]
    lines = inputs.read_text(encoding="utf-8").splitlines()
    rows = {}
    for num_proc in args.num_proc:
        head = work / f"{kind}-head-{num_proc}.jsonl"
        head.write_text("\n".join(lines[:num_proc]) + "\n", encoding="utf-8")
        runs = []
        for _ in range(args.repeats):
            before = time_encode(encode, texts[num_proc:])
            startup = time_prepare(target, head, work, args.max_len, num_proc)
            full = time_prepare(target, inputs, work, args.max_len, num_proc)
            after = time_encode(encode, texts[num_proc:])
            # The encode on both sides of the stage: a neighbour's load that comes or goes in between
            # weighs on both figures of the ratio.
            runs.append(((full[0] - startup[0], full[1] - startup[1]),
                         ((before[0] + after[0]) / 2, (before[1] + after[1]) / 2)))
        rows[num_proc] = (len(texts) - num_proc, sum(lengths[num_proc:]), runs)
    messages = sum(len(to_conversation(i, r).messages) for i, r in iter_records(resolve_inputs([inputs])))
    return {"texts": len(texts), "tokens": sum(lengths), "tokens_per_message": sum(lengths) / messages, "runs": rows}


def report(kind: str, result: dict) -> None:
    print(f"{kind}: {result['texts']:,} conversations, {result['tokens']:,} tokens (mean "
          f"{result['tokens'] / result['texts']:,.0f} per conversation, {result['tokens_per_message']:,.0f} per message)")
    for num_proc, (n, tokens, runs) in result["runs"].items():
        stage, encode = statistics.median(s[0] for s, _ in runs), statistics.median(e[0] for _, e in runs)
        # Per run: 01's tokens/s over the encode's, i.e. the encode's seconds over 01's.
        wall = [e[0] / s[0] for s, e in runs]
        line = (f"  --num-proc {num_proc}: 01 {n / stage:,.1f} conv/s, {tokens / stage:,.0f} tokens/s | own encode "
                f"(one process) {n / encode:,.1f} conv/s, {tokens / encode:,.0f} tokens/s | wall-clock ratio "
                f"{statistics.median(wall):.3f} (runs {', '.join(f'{r:.3f}' for r in wall)})")
        if num_proc == 1:  # one process: its CPU time is all the stage's work
            cpu = statistics.median(e[1] / s[1] for s, e in runs)
            line += f", CPU-time ratio {cpu:.3f}; goal >= {GOAL}: {'met' if cpu >= GOAL else 'NOT met'}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--turns", type=int, nargs=2, default=(3, 10), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--tool-share", type=float, default=0.25,
                        help="share of generated exchanges that go through a tool call (0: plain chats)")
    parser.add_argument("--input", type=Path, help="a JSONL file of conversations to use instead of generated ones")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    args = parser.parse_args()
    targets = ensure_targets(args.kinds)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs = args.input or generate(work / "long.jsonl", args.conversations, tuple(args.turns), args.tool_share)
        for kind in args.kinds:
            report(kind, bench_target(kind, targets[kind], inputs, work, args))


if __name__ == "__main__":
    main()
