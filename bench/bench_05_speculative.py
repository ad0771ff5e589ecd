"""Benchmark of step 05: greedy speculative decoding (target + EAGLE-3 draft) against plain greedy
decoding of the same target, on the same held-out prompts, in one run.

    python bench/bench_05_speculative.py [--run-dir runs/default] [--draft DIR] [--target DIR]
        [--prepared DIR] [--prompts 8] [--max-new-tokens 64] [--num-speculative-tokens 3] [--repeats 3]

Uses RUN_DIR/draft and RUN_DIR/prepared (run the main job 01 -> 04 first), prompts from 04's
validation split when RUN_DIR/hidden_states and 04's report say which it was. Each repeat decodes
every prompt both ways; the medians of the repeats give tokens per second each way, their ratio
and, beside it, the measured acceptance length (tokens per target pass). The outputs must be
identical (lossless); the script exits 1 if they are not.

On the miniature CPU targets the ratio is usually below 1: the draft (one layer of the target's
width, plus an lm_head over the draft vocabulary) costs about as much per token as the 8-layer
miniature target, and a verification pass over k+1 tokens costs more than a one-token pass. On
a real target (Kimi-K2.5: 61 layers, 1T parameters, memory-bound decoding) a target pass over
k+1 tokens costs about the same as over 1 token and the draft about 1/60 of it, so the ratio
approaches the acceptance length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from common.defaults import DEFAULT_RUN_DIR
from common.draft.model import load_draft
from common.errors import PipelineError
from common.evaluate.measure import (
    check_draft,
    degenerate_share,
    held_out,
    mean_distinct_ratio,
    measure_draft,
    measure_plain,
)
from common.evaluate.prompts import select_prompts
from common.hidden_states.loader import load_hidden_states
from common.miniatures.targets import ensure_target
from common.prepare.prepared_dataset import load_prepared
from common.target.config import load_target_info
from common.target.model import load_text_model


def run(run_dir: Path = DEFAULT_RUN_DIR, draft: Path | None = None, target: Path | None = None,
        prepared: Path | None = None, prompts: int = 8, max_new_tokens: int = 64, k: int = 3,
        repeats: int = 3, device: str = "cpu") -> dict:
    """Time both decoders on the same prompts; seconds and tokens/s are medians of `repeats`."""
    draft_dir = draft or Path(run_dir) / "draft"
    prepared_dir = prepared or Path(run_dir) / "prepared"
    if not draft_dir.is_dir() or not prepared_dir.is_dir():
        raise PipelineError(f"{draft_dir} or {prepared_dir} missing: run the main job (01 -> 04) first, "
                            "or pass --draft and --prepared")
    target_dir = target or ensure_target("kimi")
    info = load_target_info(target_dir, trust_remote_code=True)
    check_draft(draft_dir, info)
    model = load_text_model(info, device=device)
    draft_model = load_draft(draft_dir, target=info.path, trust_remote_code=True, device=device)
    ds, _ = load_prepared(prepared_dir)
    data_dir = Path(run_dir) / "hidden_states"
    split = held_out(draft_dir, load_hidden_states(data_dir) if data_dir.is_dir() else None)
    chosen, _ = select_prompts(ds, prompts, split.rows)
    stop_ids = info.stop_ids

    greedy_s, spec_s, results = [], [], []
    for _ in range(repeats):
        greedy = measure_plain(model, chosen, max_new_tokens, stop_ids, show_progress=False)
        result = measure_draft(model, draft_model, chosen, greedy, k, max_new_tokens, stop_ids, show_progress=False)
        greedy_s.append(result.greedy_seconds)
        spec_s.append(result.seconds)
        results.append(result)
    tokens = results[0].tokens
    greedy_tps, spec_tps = tokens / statistics.median(greedy_s), tokens / statistics.median(spec_s)
    return {"target": info.path, "draft": str(draft_dir), "held_out": split.rule, "prompts": len(chosen),
            "tokens": tokens, "k": k, "repeats": repeats, "greedy_tokens_per_s": greedy_tps,
            "speculative_tokens_per_s": spec_tps, "ratio": spec_tps / greedy_tps,
            "acceptance_length": results[0].stats.acceptance_length,
            "acceptance_rate_per_position": results[0].stats.acceptance_rate_per_position,
            "identical_to_greedy": all(r.identical_to_greedy for r in results),
            "degenerate_share": degenerate_share(greedy), "distinct_ratio": mean_distinct_ratio(greedy)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR, help="default: %(default)s")
    parser.add_argument("--draft", type=Path, default=None, help="draft folder (default: RUN_DIR/draft)")
    parser.add_argument("--target", type=Path, default=None, help="default: the Kimi-style miniature target")
    parser.add_argument("--prepared", type=Path, default=None, help="prompts' source (default: RUN_DIR/prepared)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per prompt (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="k (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs each way (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="default: %(default)s")
    args = parser.parse_args()
    try:
        r = run(args.run_dir, args.draft, args.target, args.prepared, args.prompts, args.max_new_tokens,
                args.num_speculative_tokens, args.repeats, args.device)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rates = ", ".join(f"{x:.2f}" for x in r["acceptance_rate_per_position"])
    print(f"target {r['target']}, draft {r['draft']}: {r['prompts']} prompts, {r['tokens']:,} tokens, k = {r['k']}, "
          f"{torch.get_num_threads()} thread(s); held-out: {r['held_out']}")
    print(f"plain greedy {r['greedy_tokens_per_s']:.1f} tok/s, speculative {r['speculative_tokens_per_s']:.1f} tok/s: "
          f"ratio {r['ratio']:#.3g} (median of {r['repeats']}; {100 * r['degenerate_share']:#.3g}% of the greedy "
          f"generations loop, distinct-token ratio {r['distinct_ratio']:#.3g}), acceptance length "
          f"{r['acceptance_length']:.3f} (per-position acceptance {rates})")
    print(f"identical to greedy: {'yes' if r['identical_to_greedy'] else 'NO'}")
    return 0 if r["identical_to_greedy"] else 1


if __name__ == "__main__":
    sys.exit(main())
