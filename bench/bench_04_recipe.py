"""Benchmark of 04's training recipe: each choice alone and together, on the same data and budget,
against upstream speculators 0.9.0's own trainer, at one or several k.

    python bench/bench_04_recipe.py [--run-dir runs/bench-recipe] [--target flat|kimi|DIR] [--max-prompts 58]
        [--max-new-tokens 64] [--variants defaults,loss-lk,...,upstream-31-head] [--seeds 0 1 2] [--ks 3 5 8]
        [--lr RATE] [--epochs N] [--no-vllm] [--control] [--table-only]
    # flat miniature: about 5 minutes per variant and seed on 2 quiet CPU cores at one k (04 3, 05 1, vLLM 1-2),
    # about 4 more per further k with vLLM; figures in RUN_DIR/bench_recipe.json

1. 01 -> 02 -> 03 once into RUN_DIR (the demo conversations, a 2048-token draft vocabulary), unless
   RUN_DIR/vocab already exists.
2. Per variant, 04 into RUN_DIR/<variant>/ with configs/draft_tiny.json's budget (4 epochs, lr 1.8e-2,
   3 TTT steps, linear schedule, 1% warm-up) and the variant's flags (and draft shape: `SHAPE_CHANGES`),
   then 05 on its exported draft: the held-out first turns (`--max-prompts`, 04's 58 validation rows),
   `--max-new-tokens` (64) each, greedy, at each k of `--ks` (default 3), with vLLM too (`--engine vllm`)
   when .venv-vllm exists and `--no-vllm` is not given. A variant whose figures for these k, length and
   engine exist (RUN_DIR/<variant>/eval_k3-5-8_vllm.json; eval_k3-5-8_t256_vllm.json at 256 tokens) is
   not run again; one trained before is only measured (delete the folder to redo it).
3. A table per k, side by side: 05's measured acceptance length and per-position acceptance rates,
   vLLM's, and 05's simulated acceptance length over the held-out rows (04's validation measure).

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
from it (`+ lr 1.8e-2`: the config's rate); `defaults` is 04 with no recipe flag; `defaults, frozen
lm_head` and `defaults, noise off` change it as upstream does (its head frozen; no noise augmentation),
`muon-wd-0.01`, `muon-wd-0.2` and `muon-wd-0.3` other Muon weight decays (upstream's 0.1 is the default). Further
variants, each on the defaults: `loss-*` (`--loss`), `ttt5`, `ttt7-nodecay` and `ttt7` (5 or 7 TTT steps, the last with
loss decay 0.8 as the EAGLE-3 reference trains; the epoch chosen at k = 3), `eagle31` (the draft
config's `norm_before_fc` and `norm_output`), and `eagle31-lk-ttt7` (the three together). `--control`
adds the defaults with a 2% lower training noise, a nudge that should not matter: how far it moves the figures is a lower bound of the noise (another initialisation
and packing order moves them more: README, 04's training recipe).
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
from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.draft.model import TINY_CONFIG
from common.miniatures.targets import ensure_target

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
    simulated: float
    by_seed: dict[int, float]  # seed -> its acceptance length (vLLM's, else 05's)

    @classmethod
    def read(cls, label: str, path: Path, seed: int, k: int) -> Result:
        """The first draft's figures at `k` in 05's --json (under `by_k` when measured at several)."""
        report = json.loads(path.read_text())
        draft = (report["by_k"][str(k)] if "by_k" in report else report)["drafts"][0]
        served = draft.get("vllm")
        result = cls(label, draft["measured_acceptance_length"], draft["acceptance_rate_per_position"],
                     served["measured_acceptance_length"] if served else None,
                     served["acceptance_rate_per_position"] if served else None,
                     draft["simulated_acceptance_length"], {})
        result.by_seed[seed] = result.vllm if result.vllm is not None else result.measured
        return result

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


@dataclass
class Budget:
    """`--lr` and `--epochs`: in place of configs/draft_tiny.json's in every variant that does not
    set its own (upstream's rows included)."""
    lr: float | None
    epochs: int | None

    def applied(self, flags: tuple[str, ...]) -> tuple[str, ...]:
        """04's flags of a variant with the budget's values it does not set itself."""
        for flag, value in (("--lr", self.lr), ("--epochs", self.epochs)):
            if value is not None and flag not in flags:
                flags = (*flags, flag, str(value))
        return flags


def folder(variant: str, seed: int) -> str:
    return variant if seed == 0 else f"{variant}-seed{seed}"


def run(script: str, *args: str | Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / script), *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def target_args(target: Path) -> list[str | Path]:
    return ["--target", target, "--trust-remote-code"]


def prepare(run_dir: Path, target: Path) -> None:
    if (run_dir / "vocab" / "d2t.pt").is_file():
        return
    common = ["--run-dir", run_dir, *target_args(target)]
    run("01_prepare_data.py", *common)
    run("02_extract_hidden_states.py", *common)
    run("03_build_vocab_map.py", *common, "--draft-vocab-size", "2048")


def draft_config(run_dir: Path, name: str) -> Path:
    """configs/draft_tiny.json, or a copy in RUN_DIR with the variant's `SHAPE_CHANGES`."""
    if name not in SHAPE_CHANGES:
        return TINY_CONFIG
    data = json.loads(Path(TINY_CONFIG).read_text())
    data["model"].update(SHAPE_CHANGES[name])
    path = run_dir / f"draft_config_{name}.json"
    write_json(path, data)
    return path


@dataclass
class Measurement:
    """How 05 measures every draft: at these k, on the first `max_prompts` held-out prompts, up to
    `max_new_tokens` each, with vLLM too or not."""
    ks: list[int]
    vllm: bool
    max_prompts: int
    max_new_tokens: int

    def file(self, run_dir: Path, name: str, seed: int) -> Path:
        """Where 05's figures of a run go (at the default length, none in the name: eval_k3_vllm.json)."""
        length = "" if self.max_new_tokens == DEFAULT_NEW_TOKENS else f"_t{self.max_new_tokens}"
        return (run_dir / folder(name, seed) /
                f"eval_k{'-'.join(map(str, self.ks))}{length}{'_vllm' if self.vllm else ''}.json")

    def args(self) -> list[str]:
        """05's flags for it."""
        return ["--max-prompts", str(self.max_prompts), "--max-new-tokens", str(self.max_new_tokens),
                "--num-speculative-tokens", *map(str, self.ks), *(["--engine", "vllm"] if self.vllm else [])]


def train_and_measure(run_dir: Path, target: Path, name: str, seed: int, flags: tuple[str, ...],
                      budget: Budget, measure: Measurement) -> Path:
    out = run_dir / folder(name, seed)
    result = measure.file(run_dir, name, seed)
    if result.is_file():
        return result
    if (out / "draft" / "config.json").is_file():
        print(f"{out.name}: trained before; measured at k = {', '.join(map(str, measure.ks))}", flush=True)
    elif name in upstream.VARIANTS:
        upstream.train_and_export(run_dir, target, out, flags, seed, budget.lr, budget.epochs)
    else:
        flags = budget.applied(flags)
        shape = "".join(f" {k}={v}" for k, v in SHAPE_CHANGES.get(name, {}).items())
        print(f"{out.name}: 04 {' '.join(flags) or '(defaults)'} --seed {seed}{' draft:' + shape if shape else ''}",
              flush=True)
        run("04_train.py", "--run-dir", run_dir, *target_args(target), "--draft-config", draft_config(run_dir, name),
            "--output", out, *flags, "--seed", str(seed))
    partial = result.with_suffix(".partial.json")
    run("05_evaluate.py", "--run-dir", run_dir, *target_args(target), "--draft", out / "draft", "--no-baselines",
        *measure.args(), "--json", partial)
    partial.replace(result)
    return result


def table(results: list[Result]) -> str:
    def rates(values: list[float] | None) -> str:
        return " / ".join(f"{v:.3f}" for v in values) if values else "-"

    rows = [f"{'variant':<42} {'05 AL':>6}  {'05 per position':<21} {'vLLM AL':>7}  {'vLLM per position':<21} "
            f"{'val sim. AL':>11}  AL by seed"]
    for r in results:
        served = f"{r.vllm:.3f}" if r.vllm is not None else "-"
        seeds = ", ".join(f"{s}: {a:.3f}" for s, a in sorted(r.by_seed.items()))
        rows.append(f"{r.label:<42} {r.measured:>6.3f}  {rates(r.rates):<21} {served:>7}  {rates(r.vllm_rates):<21} "
                    f"{r.simulated:>11.3f}  {seeds}")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "runs" / "bench-recipe")
    parser.add_argument("--target", default="flat", help="flat, kimi (the miniatures) or a target folder")
    parser.add_argument("--max-prompts", type=int, default=58, help="held-out prompts 05 decodes")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                        help="05's tokens per prompt (more: a larger measured sample of the target's text)")
    parser.add_argument("--variants", default=",".join(ALL_VARIANTS),
                        help=f"comma-separated, of {', '.join(ALL_VARIANTS)} (upstream-*: with .venv-speculators/)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="04's --seed of each run of a variant (a row is their mean; the split stays fixed)")
    parser.add_argument("--lr", type=float, help="the rate of every variant that does not set its own (04's and "
                                                 "upstream's; default: configs/draft_tiny.json's)")
    parser.add_argument("--epochs", type=int, help="the epochs of every variant that does not set its own (04's "
                                                    "and upstream's; default: configs/draft_tiny.json's)")
    parser.add_argument("--ks", type=int, nargs="+", default=[3],
                        help="the k each draft is measured at (05's --num-speculative-tokens; one table per k)")
    parser.add_argument("--no-vllm", action="store_true", help="05's own decoder only")
    parser.add_argument("--control", action="store_true", help="also the defaults with a 2%% lower noise")
    parser.add_argument("--table-only", action="store_true", help="print the table of the variants already run")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    target = ensure_target(args.target) if args.target in ("flat", "kimi") else Path(args.target)
    unknown = [v for v in args.variants.split(",") if v not in ALL_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(ALL_VARIANTS)}")
    chosen = {v: ALL_VARIANTS[v] for v in args.variants.split(",")} | ({"control": CONTROL} if args.control else {})
    if not upstream.available() and not args.table_only and any(v in upstream.VARIANTS for v in chosen):
        print(upstream.missing_message())
        chosen = {v: c for v, c in chosen.items() if v not in upstream.VARIANTS}
    measure = Measurement(args.ks, DEFAULT_VLLM_PYTHON.is_file() and not args.no_vllm, args.max_prompts,
                          args.max_new_tokens)
    if not args.table_only:
        prepare(args.run_dir, target)
    paths: dict[str, list[tuple[int, Path]]] = {}
    for name, (_label, flags) in chosen.items():
        for seed in args.seeds:
            path = measure.file(args.run_dir, name, seed)
            if not args.table_only:
                path = train_and_measure(args.run_dir, target, name, seed, flags, Budget(args.lr, args.epochs),
                                         measure)
            if path.is_file():
                paths.setdefault(name, []).append((seed, path))
    by_k = {k: [Result.mean([Result.read(chosen[name][0], path, seed, k) for seed, path in runs])
                for name, runs in paths.items()] for k in args.ks}
    for k, results in by_k.items():
        print(f"target {target}, {args.run_dir}; k = {k}, greedy, {args.max_prompts} held-out prompts, "
              f"{args.max_new_tokens} new tokens; mean over seeds {' '.join(map(str, args.seeds))}")
        print(table(results))
    write_json(args.run_dir / "bench_recipe.json",
               {"target": str(target), "results": [vars(r) for r in by_k[args.ks[0]]],
                "by_k": {str(k): [vars(r) for r in results] for k, results in by_k.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
