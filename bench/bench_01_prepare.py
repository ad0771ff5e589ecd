"""Benchmark of step 01 on long multi-turn conversations: the whole stage against the tokenizer's
own encode of the same rendered texts, for the Kimi-style and the flat miniature target.

    python bench/bench_01_prepare.py [--conversations 300] [--turns 3 10] [--repeats 3]
                                     [--num-proc 1 2] [--input FILE] [--max-len 2048]

Conversations: `--input` (a JSONL file), or generated from the shipped demo files' text (see
`generate`: long messages, as in ShareGPT-style data, and tool-call exchanges). Per target and
repeat it times
- 01: `prepare()` in this process on all conversations, minus `prepare()` on the first one alone
  (start-up cancelled: loading the tokenizer, building the masker, the dataset machinery), over
  the tokens of the rest (their full renderings, before the `--max-len` cut);
- the tokenizer's own encode, one text at a time, of the same rendered texts: Kimi's
  `tokenizer.encode(text)` (tiktoken, special tokens allowed), the fast tokenizer's
  `backend_tokenizer.encode(text, add_special_tokens=False)`;
and prints conversations/s and tokens/s of both and their ratio (01 over the encode; goal 0.3),
median of the repeats; then 01's conversations/s at each `--num-proc`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the stage's bars would interleave with the table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from common.data.conversations import iter_records, resolve_inputs, to_conversation  # noqa: E402
from common.data.loss_mask import ChatMasker  # noqa: E402
from common.data.prepare import PrepareOptions, load_tokenizer, prepare  # noqa: E402
from common.defaults import demo_inputs  # noqa: E402
from common.fixtures.targets import ensure_targets  # noqa: E402


GOAL = 0.3
KINDS = ("kimi", "flat")


def generate(out: Path, conversations: int, turns: tuple[int, int], seed: int = 0) -> Path:
    """Write `conversations` long conversations built from the demo files' text: a system prompt, then
    `turns` exchanges, each a user message of 1-3 demo questions and an answer of 3-8 demo answers
    (with their reasoning), in ShareGPT-like proportions (a few hundred tokens a message); one
    exchange in four is a demo tool-call exchange instead (call, result, answer), its tool declared."""
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
                if rng.random() < 0.25:
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


def time_prepare(target: Path, inputs: Path, work: Path, max_len: int, num_proc: int) -> float:
    out = Path(tempfile.mkdtemp(dir=work)) / "prepared"
    start = time.perf_counter()
    prepare(PrepareOptions(inputs=[inputs], target=target, output=out, max_len=max_len, num_proc=num_proc,
                           trust_remote_code=True))
    return time.perf_counter() - start


def bench_target(kind: str, target: Path, inputs: Path, work: Path, args) -> dict:
    tokenizer = load_tokenizer(target, trust_remote_code=True)
    texts = rendered_texts(inputs, ChatMasker(tokenizer))
    encode = own_encode(tokenizer)
    lengths = [len(encode(t)) for t in texts]
    tokens = sum(lengths[1:])  # the first conversation is the start-up run's
    first = work / f"{kind}-first.jsonl"
    first.write_text(inputs.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    rows = {}
    for num_proc in args.num_proc:
        runs = []
        for _ in range(args.repeats):
            startup = time_prepare(target, first, work, args.max_len, num_proc)
            stage = time_prepare(target, inputs, work, args.max_len, num_proc) - startup
            start = time.perf_counter()
            for t in texts[1:]:
                encode(t)
            runs.append((stage, time.perf_counter() - start))
        rows[num_proc] = runs
    messages = sum(len(to_conversation(i, r).messages) for i, r in iter_records(resolve_inputs([inputs])))
    return {"texts": len(texts), "tokens": tokens, "mean_tokens": sum(lengths) / len(lengths),
            "tokens_per_message": sum(lengths) / messages, "runs": rows}


def report(kind: str, result: dict) -> None:
    n, tokens = result["texts"] - 1, result["tokens"]
    print(f"{kind}: {n:,} conversations, {tokens:,} tokens (mean {result['mean_tokens']:,.0f} per conversation, "
          f"{result['tokens_per_message']:,.0f} per message)")
    for num_proc, runs in result["runs"].items():
        stage, encode = statistics.median(s for s, _ in runs), statistics.median(e for _, e in runs)
        ratio = statistics.median(e / s for s, e in runs)  # per run: 01's tokens/s over the encode's
        print(f"  --num-proc {num_proc}: 01 {n / stage:,.1f} conv/s, {tokens / stage:,.0f} tokens/s | own encode "
              f"{n / encode:,.1f} conv/s, {tokens / encode:,.0f} tokens/s | ratio {ratio:.3f} "
              f"(median of {len(runs)}; per run {', '.join(f'{e / s:.3f}' for s, e in runs)})"
              + (f"; goal >= {GOAL}: {'met' if ratio >= GOAL else 'NOT met'}" if num_proc == 1 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=300)
    parser.add_argument("--turns", type=int, nargs=2, default=(3, 10), metavar=("MIN", "MAX"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--input", type=Path, help="a JSONL file of conversations to use instead of generated ones")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    args = parser.parse_args()
    targets = ensure_targets(args.kinds)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inputs = args.input or generate(work / "long.jsonl", args.conversations, tuple(args.turns))
        for kind in args.kinds:
            report(kind, bench_target(kind, targets[kind], inputs, work, args))


if __name__ == "__main__":
    main()
