"""Benchmark of 04's training recipe: each choice alone and together, on the same data and budget,
against upstream speculators 0.9.0's own trainer and the n-gram baseline, at one or several k.

    python bench/bench_04_recipe.py [--run-dir runs/bench-recipe] [--target flat|kimi|smollm2|DIR]
        [--draft-config FILE] [--input FILE|DIR] [--conversations N] [--max-len N] [--max-prompts 58]
        [--max-new-tokens 64] [--variants defaults,loss-lk,...,upstream-31-head] [--seeds 0 1 2] [--ks 3 5 8]
        [--prompts held-out mt-bench humaneval] [--dtypes fp32 bf16] [--lr RATE] [--epochs N] [--no-vllm]
        [--control] [--table-only] [--json FILE]
    # flat miniature: about 5 minutes per variant and seed on 2 quiet CPU cores at one k (04 3, 05 1, vLLM 1-2),
    # about 4 more per further k with vLLM; figures in RUN_DIR/bench_recipe.json (or --json FILE)

1. 01 -> 02 -> 03 once into RUN_DIR, unless RUN_DIR/vocab already exists: the demo conversations and
   a 2048-token draft vocabulary for the miniatures and target folders; for the built-in real target
   (`--target smollm2`) the first `--conversations` (2000) ShareGPT conversations
   (scripts/fetch_sharegpt.py) and the draft config's vocabulary (32,000). `--input` gives 01 another
   source (a ShareGPT file, or 00_regenerate.py's folder: the target's own answers), `--max-len` 01's
   length.
2. Per variant, 04 into RUN_DIR/<variant>/ with the draft config's budget (`--draft-config`, default
   the target's own: configs/draft_smollm2.json for smollm2, configs/draft_tiny.json otherwise: 4
   epochs, lr 1.8e-2, 3 TTT steps, linear schedule, 1% warm-up) and the variant's flags (and draft shape:
   `SHAPE_CHANGES`), then 05 on its exported draft, greedy, `--max-new-tokens` (64) each, at each k of
   `--ks` (default 3), with vLLM too (`--engine vllm`) when .venv-vllm exists and `--no-vllm` is not
   given, once per prompt set of `--prompts` (default `held-out`: the first `--max-prompts` of 04's
   validation rows; `mt-bench`, `humaneval` or a file: 05's `--prompts`, their first `--max-prompts`
   items) and compute dtype of `--dtypes` (default 05's own: fp32 on the CPU, bf16 with vLLM). A
   variant whose figures for these k, length, prompts, dtype and engine exist
   (RUN_DIR/<variant>/eval_k3-5-8_vllm.json; eval_k3-5-8_t256_mt-bench_fp32_vllm.json at 256 tokens
   on MT-Bench in fp32) is not run again; one trained before is only measured (delete the folder to
   redo it). The first variant's seed-0 measurement also decodes 05's baselines: the n-gram row
   (prompt lookup by vLLM's rule, 05's decoder).
3. A table per k, prompt set and dtype, side by side: 05's measured acceptance length and
   per-position acceptance rates, vLLM's, and 05's simulated acceptance length over the held-out
   rows (04's validation measure).

`--seeds 0 1 2` trains every variant once per seed (`--seed`: the draft's initialisation, the packing
order, the noise; the held-out split stays `--split-seed` 0's, so every seed is measured on the same
prompts) into RUN_DIR/<variant>/ for seed 0 and RUN_DIR/<variant>-seed<S>/ for the others. A row is
then the mean over its seeds, with each seed's acceptance length beside it (vLLM's, else 05's): one
seed's figures move by a few hundredths, so variants closer than that are not told apart by one seed.
`--lr RATE` and `--epochs N` replace the config's rate and epochs in every variant that does not set its
own, the upstream rows too: a budget tried on both trainers (in a run folder of its own, as every
variant's folder is reused).

The `upstream-*` variants train the same draft with speculators 0.9.0's own trainer instead of 04,
on the same rows, vocabulary, shape and budget, in its own environment (bench/upstream/adapter.py;
run only when .venv-speculators/ exists: scripts/setup_speculators_env.sh), and are measured by 05
the same way: `upstream-muon` (its defaults but 04's architecture: Muon, draft lm_head frozen),
`upstream-muon-head` (lm_head trained, as 04 does), `upstream-adamw` (AdamW, lm_head frozen),
`upstream-31-head` (its eagle3 defaults with EAGLE-3.1's norms, lm_head trained) and
`upstream-31-head-lk` (the same with its LK loss, `nla`).

Variants of 04: `before` is 04 with none of its recipe's choices (AdamW, TTT steps fed the draft's own
guesses, PyTorch's initialisation, draft lm_head trained, lr 6e-3); each `+ ...` row changes one thing
from it (`+ lr 1.8e-2`: the miniatures' rate); `defaults` is 04 with no recipe flag; `defaults, frozen
lm_head` and `defaults, noise off` change it as upstream does (its head frozen; no noise augmentation),
`muon-wd-0.01`, `muon-wd-0.2` and `muon-wd-0.3` other Muon weight decays (upstream's 0.1 is the default). Further
variants, each on the defaults: `loss-*` (`--loss`), `ttt5`, `ttt7-nodecay` and `ttt7` (5 or 7 TTT steps, the last with
loss decay 0.8 as the EAGLE-3 reference trains; the epoch chosen at k = 3), `eagle31` (the draft
config's `norm_before_fc` and `norm_output`), and `eagle31-lk-ttt7` (the three together). `--control`
adds the defaults with a 2% lower training noise, a nudge that should not matter: how far it moves
the figures is a lower bound of the noise (another initialisation and packing order moves them more:
README, 04's training recipe).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.upstream import adapter as upstream
from common.atomic import write_json
from common.cli import REAL_TARGETS, builtin_target
from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.draft.model import TINY_CONFIG, default_config, read_config_file
from common.evaluate.prompt_sets import PUBLISHED_SETS, fetch_published_set, resolve_prompt_set
from common.evaluate.prompts import HELD_OUT
from common.miniatures.targets import ensure_target
from common.prepare.sharegpt import fetch_sharegpt

# The `before` variant: 04 with none of its recipe's choices (AdamW, draft-fed TTT, torch init, lm_head trained,
# lr 6e-3 where configs/draft_tiny.json has 1.8e-2).
BEFORE = ("--optimizer", "adamw", "--ttt-inputs", "draft", "--init", "torch", "--no-freeze-draft-lm-head",
          "--lr", "0.006")


def changed(flag: str, value: str | None = None) -> tuple[str, ...]:
    """BEFORE with one flag changed (or a bool flag flipped)."""
    args = list(BEFORE)
    if value is None:  # --no-X -> --X
        args[args.index(f"--no-{flag.removeprefix('--')}")] = flag
    else:
        args[args.index(flag) + 1] = value
    return tuple(args)


VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {  # name -> (row label, 04 flags), in the order they run
    "before": ("before: AdamW, draft-fed TTT, torch init", BEFORE),
    "defaults": ("defaults (no recipe flag)", ()),
    "teacher-forced": ("+ TTT fed the dataset's tokens", changed("--ttt-inputs", "dataset")),
    "muon": ("+ Muon", changed("--optimizer", "muon")),
    "frozen-head": ("+ draft lm_head frozen", changed("--freeze-draft-lm-head")),
    "normal-init": ("+ normal init (0.02)", changed("--init", "normal")),
    "lr": ("+ lr 1.8e-2", changed("--lr", "0.018")),
    "defaults-frozen-head": ("defaults, draft lm_head frozen", ("--freeze-draft-lm-head",)),
    "defaults-no-noise": ("defaults, noise off (as upstream)", ("--noise-std", "0")),
    "target-temperature-1": ("defaults, target at temperature 1 (the library's)", ("--target-temperature", "1")),
    "target-temperature-0.7": ("defaults, target at temperature 0.7", ("--target-temperature", "0.7")),
    "muon-wd-0.01": ("defaults, Muon weight decay 0.01 (AdamW's)", ("--muon-weight-decay", "0.01")),
    "muon-wd-0.2": ("defaults, Muon weight decay 0.2", ("--muon-weight-decay", "0.2")),
    "muon-wd-0.3": ("defaults, Muon weight decay 0.3", ("--muon-weight-decay", "0.3")),
    # the losses, TTT depths and EAGLE-3.1's norms, each alone on the defaults, and together
    "loss-tv": ("defaults, TV loss", ("--loss", "tv")),
    "loss-lk": ("defaults, LK loss (-log acceptance)", ("--loss", "lk")),
    "loss-lk-hybrid": ("defaults, LK hybrid loss", ("--loss", "lk-hybrid")),
    "loss-jsd": ("defaults, JSD loss", ("--loss", "jsd")),
    "loss-rkl": ("defaults, reverse KL loss", ("--loss", "rkl")),
    "ttt7": ("defaults, 7 TTT steps, decay 0.8",
             ("--ttt-steps", "7", "--ttt-step-loss-decay", "0.8", "--select-k", "3")),
    "ttt7-nodecay": ("defaults, 7 TTT steps", ("--ttt-steps", "7", "--select-k", "3")),
    "ttt5": ("defaults, 5 TTT steps", ("--ttt-steps", "5", "--select-k", "3")),
    "eagle31": ("defaults, EAGLE-3.1 norms", ()),
    "eagle31-lk-ttt7": ("defaults, EAGLE-3.1 norms, LK, 7 TTT steps",
                        ("--loss", "lk", "--ttt-steps", "7", "--ttt-step-loss-decay", "0.8", "--select-k", "3")),
}
# Variants trained with a draft shape other than configs/draft_tiny.json's: its `model` section changed so.
SHAPE_CHANGES = {"eagle31": {"norm_before_fc": True, "norm_output": True},
                 "eagle31-lk-ttt7": {"norm_before_fc": True, "norm_output": True}}
DEFAULT_NEW_TOKENS = 64  # 05's own default
CONTROL = ("control: defaults, noise 0.049", ("--noise-std", "0.049"))
ALL_VARIANTS = VARIANTS | upstream.VARIANTS  # then speculators 0.9.0's own trainer (bench/upstream/adapter.py)


@dataclass
class Result:
    label: str
    measured: float
    rates: list[float]
    vllm: float | None
    vllm_rates: list[float] | None
    simulated: float | None
    by_seed: dict[int, float]  # seed -> its acceptance length (vLLM's, else 05's)

    @classmethod
    def read(cls, label: str, path: Path, seed: int, k: int) -> Result:
        """The first draft's figures at `k` in 05's --json."""
        draft = at_k(path, k)["drafts"][0]
        served = draft.get("vllm")
        result = cls(label, draft["measured_acceptance_length"], draft["acceptance_rate_per_position"],
                     served["measured_acceptance_length"] if served else None,
                     served["acceptance_rate_per_position"] if served else None,
                     draft["simulated_acceptance_length"], {})
        result.by_seed[seed] = result.vllm if result.vllm is not None else result.measured
        return result

    @classmethod
    def ngram(cls, path: Path, k: int) -> Result | None:
        """The n-gram baseline's figures at `k` in 05's --json, if that run decoded the baselines."""
        ngram = at_k(path, k).get("baselines", {}).get("ngram")
        if ngram is None:
            return None
        return cls(NGRAM_LABEL, ngram["measured_acceptance_length"], ngram["acceptance_rate_per_position"],
                   None, None, None, {})

    @classmethod
    def mean(cls, results: list[Result]) -> Result:
        """One row for a variant's seeds: every figure averaged (vLLM's only if every seed has it)."""
        def avg(values: list) -> float:
            return sum(values) / len(values)

        def avg_rates(lists: list[list[float]]) -> list[float]:
            return [avg(column) for column in zip(*lists)]

        served = all(r.vllm is not None for r in results)
        return cls(results[0].label, avg([r.measured for r in results]), avg_rates([r.rates for r in results]),
                   avg([r.vllm for r in results]) if served else None,
                   avg_rates([r.vllm_rates for r in results]) if served else None,
                   avg([r.simulated for r in results]), {s: a for r in results for s, a in r.by_seed.items()})


NGRAM_LABEL = "n-gram: prompt lookup (vLLM's rule)"


def at_k(path: Path, k: int) -> dict:
    """05's --json figures at `k` (under `by_k` when it measured several)."""
    report = json.loads(path.read_text())
    return report["by_k"][str(k)] if "by_k" in report else report


@dataclass
class Budget:
    """`--lr` and `--epochs`: in place of the draft config's in every variant that does not set its
    own (upstream's rows included)."""
    lr: float | None
    epochs: int | None

    def applied(self, flags: tuple[str, ...]) -> tuple[str, ...]:
        """04's flags of a variant with the budget's values it does not set itself."""
        for flag, value in (("--lr", self.lr), ("--epochs", self.epochs)):
            if value is not None and flag not in flags:
                flags = (*flags, flag, str(value))
        return flags


@dataclass(frozen=True)
class Bench:
    """Where the variants run: the run folder, the target and the draft config (shape and budget)."""
    run_dir: Path
    target: Path
    config: Path

    def out(self, variant: str, seed: int) -> Path:
        return self.run_dir / (variant if seed == 0 else f"{variant}-seed{seed}")


def run(script: str, *args: str | Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / script), *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def target_args(target: Path) -> list[str | Path]:
    return ["--target", target, "--trust-remote-code"]


def resolve(target_name: str, config: Path | None) -> tuple[Path, Path]:
    """(target folder, draft config): a miniature, the built-in real target (its own config), or a folder."""
    if target_name in ("flat", "kimi"):
        target = ensure_target(target_name)
    elif target_name in REAL_TARGETS and not Path(target_name).exists():
        target = builtin_target(target_name)
    else:
        target = Path(target_name)
    default = default_config(target_name) if target_name in REAL_TARGETS else TINY_CONFIG
    return target, (config or default).resolve()


def prepare(run_dir: Path, target_name: str, target: Path, config: Path, source: Path | None = None,
            conversations: int = 2000, max_len: int | None = None) -> None:
    """01 -> 02 -> 03 once into `run_dir` (nothing when RUN_DIR/vocab exists): 01 on `source`, else
    on the demo conversations, or for a built-in real target the first `conversations` ShareGPT
    conversations; 03's vocabulary the draft config's size (2048 where it leaves it to 03)."""
    if (run_dir / "vocab" / "d2t.pt").is_file():
        return
    if source is None and target_name in REAL_TARGETS:
        source, _ = fetch_sharegpt(conversations, seed=0, out=run_dir / f"sharegpt_{conversations}.jsonl")
    common = ["--run-dir", run_dir, *target_args(target)]
    run("01_prepare_data.py", *common, *(["--input", source] if source else []),
        *(["--max-len", str(max_len)] if max_len else []))
    run("02_extract_hidden_states.py", *common)
    run("03_build_vocab_map.py", *common,
        "--draft-vocab-size", str(read_config_file(config).model.draft_vocab_size or 2048))


def draft_config(bench: Bench, name: str) -> Path:
    """The bench's draft config, or a copy in RUN_DIR with the variant's `SHAPE_CHANGES`."""
    if name not in SHAPE_CHANGES:
        return bench.config
    data = json.loads(bench.config.read_text())
    data["model"].update(SHAPE_CHANGES[name])
    path = bench.run_dir / f"draft_config_{name}.json"
    write_json(path, data)
    return path


@dataclass(frozen=True)
class Measurement:
    """How 05 measures every draft: at these k, on the first `max_prompts` prompts of one prompt set
    (HELD_OUT: 04's held-out rows), up to `max_new_tokens` each, in one compute dtype (None: 05's
    default), with vLLM too or not."""
    ks: tuple[int, ...]
    vllm: bool
    max_prompts: int
    max_new_tokens: int
    prompts: str = HELD_OUT
    dtype: str | None = None

    def file(self, out: Path) -> Path:
        """Where 05's figures of the run in `out` go (at the defaults, none in the name: eval_k3_vllm.json)."""
        parts = [f"k{'-'.join(map(str, self.ks))}",
                 *([f"t{self.max_new_tokens}"] if self.max_new_tokens != DEFAULT_NEW_TOKENS else []),
                 *([resolve_prompt_set(self.prompts)[0]] if self.prompts != HELD_OUT else []),
                 *([self.dtype] if self.dtype else []), *(["vllm"] if self.vllm else [])]
        return out / f"eval_{'_'.join(parts)}.json"

    def args(self) -> list[str]:
        """05's flags for it."""
        return ["--max-prompts", str(self.max_prompts), "--max-new-tokens", str(self.max_new_tokens),
                "--num-speculative-tokens", *map(str, self.ks), *(["--engine", "vllm"] if self.vllm else []),
                *(["--prompts", self.prompts] if self.prompts != HELD_OUT else []),
                *(["--dtype", self.dtype] if self.dtype else [])]

    def title(self, k: int) -> str:
        where = (f"{self.max_prompts} held-out prompts" if self.prompts == HELD_OUT
                 else f"the first {self.max_prompts} items of {self.prompts}")
        dtype = self.dtype or "05's default dtype"
        return f"k = {k}, greedy, {where}, {self.max_new_tokens} new tokens, {dtype}{', vLLM' if self.vllm else ''}"

    def ready(self) -> None:
        """A published prompt set fetched once (scripts/fetch_prompt_sets.py's files)."""
        if self.prompts in PUBLISHED_SETS and not PUBLISHED_SETS[self.prompts].path.is_file():
            fetch_published_set(self.prompts)


def train(bench: Bench, name: str, seed: int, flags: tuple[str, ...], budget: Budget) -> Path:
    """The variant's draft folder at `seed`, trained unless it was before."""
    out = bench.out(name, seed)
    if (out / "draft" / "config.json").is_file():
        return out / "draft"
    if name in upstream.VARIANTS:
        return upstream.train_and_export(bench.run_dir, bench.target, out, flags, seed, budget.lr, budget.epochs,
                                         bench.config)
    flags = budget.applied(flags)
    shape = "".join(f" {k}={v}" for k, v in SHAPE_CHANGES.get(name, {}).items())
    print(f"{out.name}: 04 {' '.join(flags) or '(defaults)'} --seed {seed}{' draft:' + shape if shape else ''}",
          flush=True)
    run("04_train.py", "--run-dir", bench.run_dir, *target_args(bench.target), "--draft-config",
        draft_config(bench, name), "--output", out, *flags, "--seed", str(seed))
    return out / "draft"


def measure(bench: Bench, draft: Path, measurement: Measurement, baselines: bool) -> Path:
    """05's figures of `draft` (and of its baselines when `baselines`), measured unless they were before."""
    result = measurement.file(draft.parent)
    if result.is_file():
        return result
    print(f"{draft.parent.name}: 05 {' '.join(measurement.args())}", flush=True)
    partial = result.with_suffix(".partial.json")
    run("05_evaluate.py", "--run-dir", bench.run_dir, *target_args(bench.target), "--draft", draft,
        *([] if baselines else ["--no-baselines"]), *measurement.args(), "--json", partial)
    partial.replace(result)
    return result


def table(results: list[Result]) -> str:
    def rates(values: list[float] | None) -> str:
        return " / ".join(f"{v:.3f}" for v in values) if values else "-"

    def figure(value: float | None) -> str:
        return f"{value:.3f}" if value is not None else "-"

    w = max([len("vLLM per position")] + [len(rates(r.rates)) for r in results])
    rows = [f"{'variant':<42} {'05 AL':>6}  {'05 per position':<{w}} {'vLLM AL':>7}  {'vLLM per position':<{w}} "
            f"{'val sim. AL':>11}  AL by seed"]
    for r in results:
        seeds = ", ".join(f"{s}: {a:.3f}" for s, a in sorted(r.by_seed.items()))
        rows.append(f"{r.label:<42} {r.measured:>6.3f}  {rates(r.rates):<{w}} {figure(r.vllm):>7}  "
                    f"{rates(r.vllm_rates):<{w}} {figure(r.simulated):>11}  {seeds}")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench-recipe")
    parser.add_argument("--target", default="flat",
                        help=f"flat, kimi (the miniatures), {', '.join(REAL_TARGETS)} (built-in real) or a folder")
    parser.add_argument("--draft-config", type=Path,
                        help="the variants' shape and budget (default: the target's own, else configs/draft_tiny.json)")
    parser.add_argument("--input", type=Path, help="01's source (default: the demo conversations, or ShareGPT for "
                                                   "a built-in real target); a 00_regenerate.py folder for the "
                                                   "target's own answers")
    parser.add_argument("--conversations", type=int, default=2000,
                        help="ShareGPT conversations of a built-in real target without --input")
    parser.add_argument("--max-len", type=int, help="01's --max-len (default: 01's)")
    parser.add_argument("--max-prompts", type=int, default=58, help="prompts 05 decodes, of each prompt set")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                        help="05's tokens per prompt (more: a larger measured sample of the target's text)")
    parser.add_argument("--prompts", nargs="+", default=[HELD_OUT],
                        help=f"the prompt sets each draft is measured on: {HELD_OUT} (04's validation rows), "
                             f"{', '.join(PUBLISHED_SETS)} or a file (05's --prompts)")
    parser.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16", "fp32"],
                        help="05's --dtype of each measurement (default: 05's own)")
    parser.add_argument("--variants", default=",".join(ALL_VARIANTS),
                        help=f"comma-separated, of {', '.join(ALL_VARIANTS)} (upstream-*: with .venv-speculators/)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="04's --seed of each run of a variant (a row is their mean; the split stays fixed)")
    parser.add_argument("--lr", type=float, help="the rate of every variant that does not set its own (04's and "
                                                 "upstream's; default: the draft config's)")
    parser.add_argument("--epochs", type=int, help="the epochs of every variant that does not set its own (04's "
                                                    "and upstream's; default: the draft config's)")
    parser.add_argument("--ks", type=int, nargs="+", default=[3],
                        help="the k each draft is measured at (05's --num-speculative-tokens; one table per k)")
    parser.add_argument("--no-vllm", action="store_true", help="05's own decoder only")
    parser.add_argument("--control", action="store_true", help="also the defaults with a 2%% lower noise")
    parser.add_argument("--table-only", action="store_true", help="print the table of the variants already run")
    parser.add_argument("--json", type=Path, help="the figures (default: RUN_DIR/bench_recipe.json)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    target, config = resolve(args.target, args.draft_config)
    bench = Bench(args.run_dir, target, config)
    unknown = [v for v in args.variants.split(",") if v not in ALL_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(ALL_VARIANTS)}")
    chosen = {v: ALL_VARIANTS[v] for v in args.variants.split(",")} | ({"control": CONTROL} if args.control else {})
    if not upstream.available() and not args.table_only and any(v in upstream.VARIANTS for v in chosen):
        print(upstream.missing_message())
        chosen = {v: c for v, c in chosen.items() if v not in upstream.VARIANTS}
    measurements = [Measurement(tuple(args.ks), DEFAULT_VLLM_PYTHON.is_file() and not args.no_vllm, args.max_prompts,
                                args.max_new_tokens, prompts, dtype)
                    for prompts in args.prompts for dtype in (args.dtypes or [None])]
    if not args.table_only:
        prepare(args.run_dir, args.target, target, config, args.input, args.conversations, args.max_len)
        for m in measurements:
            m.ready()
    first = next(iter(chosen), None)
    figures: dict[str, list] = {}
    for m in measurements:
        paths: dict[str, list[tuple[int, Path]]] = {}
        for name, (_label, flags) in chosen.items():
            for seed in args.seeds:
                path = m.file(bench.out(name, seed))
                if not args.table_only:
                    draft = train(bench, name, seed, flags, Budget(args.lr, args.epochs))
                    path = measure(bench, draft, m, baselines=(name, seed) == (first, args.seeds[0]))
                if path.is_file():
                    paths.setdefault(name, []).append((seed, path))
        for k in args.ks:
            results = [Result.mean([Result.read(chosen[name][0], path, seed, k) for seed, path in runs])
                       for name, runs in paths.items()]
            ngram = next((r for r in (Result.ngram(p, k) for runs in paths.values() for _, p in runs) if r), None)
            rows = results + ([ngram] if ngram else [])
            print(f"target {target}, {args.run_dir}; {m.title(k)}; mean over seeds {' '.join(map(str, args.seeds))}")
            print(table(rows))
            figures.setdefault("tables", []).append(
                {"k": k, "prompts": m.prompts, "dtype": m.dtype, "vllm": m.vllm, "max_prompts": m.max_prompts,
                 "max_new_tokens": m.max_new_tokens, "results": [vars(r) for r in rows]})
    write_json(args.json or args.run_dir / "bench_recipe.json",
               {"target": str(target), "draft_config": str(config), "seeds": args.seeds, **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
