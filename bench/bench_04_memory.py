"""Benchmark of the trainer-memory model: 04's training step measured against what
common/train/memory_plan.py plans, at scaled draft shapes on CPU, with and without activation
checkpointing.

    python bench/bench_04_memory.py [--json FILE] [--fsdp] [--grad-accum N] [--shapes NAME ...]
    torchrun --nproc-per-node 2 bench/bench_04_memory.py --fsdp [...]   # FSDP over 2 gloo ranks

Each case trains `--steps` packed batches through 04's own `ProjectTrainer` (Muon, the KL loss at
target temperature 0.5, the project's patch installed, common/draft/forward.py's forward when
checkpointing) on synthetic states, the draft built from a stand-in target (config.json plus only the
embedding and lm_head) of the shape's target vocabulary, as bench/gpu_train_full_shape.py builds its
cases. The peak is measured by `PeakTracker` (every live tensor storage, exact) over `--steps` batches
after the trainer is built and primed: every batch but a run's first finds the gradients of the step
before (04 zeroes them after its forward) and the optimizer's state, so the trainer first gets zero
gradients and one optimizer step on them (which makes Muon's and AdamW's state), and the first batch
measured is already at the steady peak. Batches are made one at a time as the loader hands them over.

The shapes vary hidden size, draft vocabulary and pack size (`SHAPES`), large enough that weights and
activations are hundreds of MB, small enough that a case takes seconds on two cores; the first three
are bound by their activations, the last (`layer_bound`) has Kimi-K2.5's ratio of decoder-layer
parameters to a 2,048-token pack's states, so that FSDP's units, their gathers and reduce-scatters
and the optimizer step weigh in its peak as they do on the full draft. Prints per case the measured and
planned peak, their ratio (goal: within 15%) and the planned peak's phase, and per activation-bound
shape the checkpointed peak over the plain one (goal: at most 0.6); `--json` writes them.

`--fsdp` runs the same cases under FSDP (bf16 weights gathered as on GPUs, autocast on CPU): the
sharded path's structure (units gathered, the root kept whole, the reduce-scatters, ShardedMuon's
gathers). Started plainly it runs on one gloo rank, where nothing is divided and FSDP copies each
shard into its unsharded parameter directly (no all-gather buffer); under `torchrun` on as many gloo
ranks as it starts, where the collectives' buffers are real (all-gather outputs, reduce-scatter inputs
kept until the next one) and each rank holds 1/world of the state: the measured peak is the largest
rank's, the plan's is for that many ranks. `--grad-accum N` measures one optimizer step of N batches
(04's --grad-accum: under FSDP each batch's gradients are reduce-scattered into the sharded ones).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bench.gpu_train_full_shape import TimedBatches, write_standin_target
from common.atomic import write_json
from common.draft import patch
from common.draft.model import DraftConfigFile, DraftShape, build_draft, speculator_config
from common.target.config import load_target_info
from common.train.memory_plan import DraftDims, PeakTracker, TrainSetup, peak_memory
from common.train.settings import TrainSettings
from common.train.trainer import ProjectTrainer, prepare_draft, trainer_config
from common.vocab import build_maps

MB = 1e6
GOAL_RATIO = 0.15  # measured within 15% of planned
GOAL_CHECKPOINTING = 0.6  # checkpointed peak at most 0.6 of plain
TARGET_TEMPERATURE = 0.5  # configs/draft_kimi_k25.json's


@dataclass(frozen=True)
class BenchShape:
    name: str
    hidden: int
    heads: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    total_seq_len: int
    head_dim: int = 64
    layer_bound: bool = False  # sized for the layer's FSDP terms, not for checkpointing's gain

    def dims(self) -> DraftDims:
        return DraftDims(self.hidden, 1, self.heads, self.heads, self.head_dim, self.intermediate, self.draft_vocab,
                         self.target_vocab)

    def draft_shape(self) -> DraftShape:
        return DraftShape(hidden_size=self.hidden, num_hidden_layers=1, num_attention_heads=self.heads,
                          num_key_value_heads=self.heads, head_dim=self.head_dim, intermediate_size=self.intermediate,
                          draft_vocab_size=self.draft_vocab)


# Kimi-K2.5's draft proportions (intermediate = 2.57 x hidden, one layer) scaled down; the pack's tokens
# x the draft vocabulary set the [tokens x vocabulary] tensors that checkpointing removes.
SHAPES = {s.name: s for s in (
    BenchShape("h256-v16k-t2048", 256, 4, 768, 16_000, 64_000, 2048),
    BenchShape("h512-v4k-t2048", 512, 4, 1536, 4_000, 32_000, 2048),
    BenchShape("h384-v8k-t1536", 384, 6, 1152, 8_000, 48_000, 1536),
    # Kimi-K2.5's draft at 2,048 tokens scaled by 7: head width 128, the layer's 15M parameters ~58x
    # the pack's tokens x hidden (Kimi: 0.81B, 55x), the vocabularies ~4 and ~23 x hidden
    BenchShape("h1024-v4k-t256", 1024, 8, 2560, 4_000, 24_000, 256, head_dim=128, layer_bound=True),
)}


@dataclass
class Case:
    shape: str
    hidden: int
    heads: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    total_seq_len: int
    checkpointing: bool
    fsdp: bool
    ranks: int
    grad_accum: int
    measured_bytes: int
    planned_bytes: int
    ratio: float  # measured / planned
    planned_phase: str
    seconds_per_step: float


def prime(trainer: ProjectTrainer) -> None:
    """Gradients and optimizer state as every batch after a run's first finds them: zero gradients on
    what trains and one optimizer step on them, which creates the optimizer's state (its values do
    not matter here)."""
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    trainer.opt.step()


def plan_setup(shape: BenchShape, checkpointing: bool, fsdp: bool, grad_accum: int = 1, ranks: int = 1) -> TrainSetup:
    return TrainSetup(total_seq_len=shape.total_seq_len, ranks=ranks, precision="bf16" if fsdp else "fp32",
                      device="cpu", checkpointing=checkpointing, fsdp=fsdp, grad_accum=grad_accum)


def world() -> tuple[int, int]:
    """(rank, ranks) of the process group, (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def run_case(shape: BenchShape, checkpointing: bool, fsdp: bool, steps: int, out: Path, grad_accum: int = 1) -> Case:
    """Build 04's trainer for `shape` and measure the peak of `steps` training batches (at least one
    accumulation group); over several ranks, the largest rank's peak."""
    steps = max(steps, grad_accum)
    rank, ranks = world()
    if ranks > 1:
        out = out / f"rank{rank}"
    patch.apply(compile_forward=False, loss="kl", target_temperature=TARGET_TEMPERATURE,
                activation_checkpointing=checkpointing)
    target = write_standin_target(out / f"target-{shape.hidden}-{shape.target_vocab}", shape.hidden,
                                  torch.device("cpu"), shape.target_vocab)
    info = load_target_info(target, trust_remote_code=True)
    flags = {"total_seq_len": shape.total_seq_len, "scheduler": "none", "epochs": 1, "optimizer": "muon",
             "precision": "bf16" if fsdp else "fp32", "target_temperature": TARGET_TEMPERATURE,
             "activation_checkpointing": checkpointing, "grad_accum": grad_accum}
    settings, _ = TrainSettings.resolve(DraftConfigFile(Path(shape.name), shape.draft_shape(), {}), flags)
    d2t, t2d = build_maps(torch.arange(shape.target_vocab, 0, -1), shape.draft_vocab)
    torch.manual_seed(0)
    model = build_draft(speculator_config(shape.draft_shape(), info, d2t.numel(), [2, 30, 58], settings.ttt_steps),
                        t2d, d2t)
    prepare_draft(model, settings)
    batches = TimedBatches(steps, shape.total_seq_len, shape.hidden, shape.target_vocab, ahead=False)
    config = trainer_config(settings, out / "checkpoints", False, fsdp, torch.device("cpu"))
    trainer = ProjectTrainer(model, config, settings, batches, None, None)
    prime(trainer)
    tracker = PeakTracker()
    tracker.track(model.parameters(), model.buffers(), [p.grad for p in model.parameters() if p.grad is not None],
                  trainer.opt.state.values())
    with tracker:
        trainer.train_epoch(0)
    step_seconds = [b - a for a, b in zip(batches.times, batches.times[1:])]
    del trainer, model
    gc.collect()
    measured = tracker.peak
    if ranks > 1:
        peaks = torch.tensor([measured], dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        measured = int(peaks.item())
    planned = peak_memory(shape.dims(), plan_setup(shape, checkpointing, fsdp, grad_accum, ranks))
    return Case(shape.name, shape.hidden, shape.heads, shape.intermediate, shape.draft_vocab, shape.target_vocab,
                shape.total_seq_len, checkpointing, fsdp, ranks, grad_accum, measured, planned.total,
                measured / planned.total, planned.phase, sum(step_seconds) / len(step_seconds))


def checkpointing_ratios(cases: list[Case]) -> dict[str, float]:
    """Per activation-bound shape, the checkpointed peak over the plain one, and the worst of them."""
    ratios = {}
    for name in dict.fromkeys(c.shape for c in cases if not SHAPES[c.shape].layer_bound):
        by_mode = {c.checkpointing: c.measured_bytes for c in cases if c.shape == name}
        if len(by_mode) == 2:
            ratios[name] = by_mode[True] / by_mode[False]
    if ratios:
        ratios["worst"] = max(ratios.values())
    return ratios


def table(cases: list[Case], ratios: dict[str, float]) -> str:
    rows = [f"{'shape':<18} {'ckpt':>4} {'measured MB':>11} {'planned MB':>10} {'ratio':>6}  {'planned peak at':<44} "
            f"{'s/step':>6}"]
    for c in cases:
        rows.append(f"{c.shape:<18} {'on' if c.checkpointing else 'off':>4} {c.measured_bytes / MB:>11,.1f} "
                    f"{c.planned_bytes / MB:>10,.1f} {c.ratio:>6.3f}  {c.planned_phase:<44} {c.seconds_per_step:>6.1f}")
    if ratios:
        rows.append("checkpointed / plain peak: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return "\n".join(rows)


def start_group() -> None:
    """The gloo process group torchrun started, or one of one rank as torchrun would start it."""
    if "LOCAL_RANK" in os.environ:
        dist.init_process_group("gloo")
        return
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29541"),
                       "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    dist.init_process_group("gloo", rank=0, world_size=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--steps", type=int, default=1, help="training batches measured per case")
    parser.add_argument("--fsdp", action="store_true", help="under FSDP on one gloo rank, bf16 (see above)")
    parser.add_argument("--grad-accum", type=int, default=1, help="batches per optimizer step (04's --grad-accum)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/memory04"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.fsdp:
        start_group()
    main_rank = world()[0] == 0
    cases = []
    for name in args.shapes:
        for checkpointing in (False, True):
            cases.append(run_case(SHAPES[name], checkpointing, args.fsdp, args.steps, args.out, args.grad_accum))
            if main_rank:
                print(table(cases[-1:], {}).splitlines()[-1], flush=True)
    ratios = checkpointing_ratios(cases)
    within = all(abs(c.ratio - 1) <= GOAL_RATIO for c in cases)
    if main_rank:
        print(table(cases, ratios))
        print(f"measured within {GOAL_RATIO:.0%} of planned at every case: {'yes' if within else 'NO'}; checkpointed "
              f"peak at most {GOAL_CHECKPOINTING} of plain: "
              f"{'yes' if ratios.get('worst', 1) <= GOAL_CHECKPOINTING else 'NO'}")
    if args.json is not None and main_rank:
        write_json(args.json, {"device": "cpu", "fsdp": args.fsdp, "ranks": world()[1], "grad_accum": args.grad_accum,
                               "steps": args.steps, "torch": torch.__version__,
                               "shapes": [asdict(c) for c in cases], "checkpointing_peak_ratio": ratios,
                               "goal_ratio": GOAL_RATIO, "goal_checkpointing": GOAL_CHECKPOINTING})
        print(f"written to {args.json}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
