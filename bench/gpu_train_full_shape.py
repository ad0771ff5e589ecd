"""GPU check of step 04 at Kimi-K2.5's full draft shape: training steps of the draft of
configs/draft_kimi_k25.json (hidden 7168, 64 heads of 128, intermediate 18432, verifier vocabulary
163,840, draft vocabulary 32,000) through 04's own Trainer (common/train/trainer.py: Muon, bf16
autocast on GPUs, the project's patch), on synthetic hidden states, at 2,048 and 8,192 tokens per
step, eager and with `torch.compile`. Prints per case tokens/s, ms per optimizer step and the optimizer's
share of it, MFU against the GPU's dense bf16 peak, the peak memory beside what
common/train/memory_plan.py plans for it, and what one epoch of 1,000 and of 500,000 samples of 2,048
tokens would take on 8 such GPUs.

    python bench/gpu_train_full_shape.py [--seq-lens 2048 8192] [--compile both|on|off] [--steps 6]
        [--precision auto|bf16|fp32] [--peak-tflops 989] [--json FILE]     # about 3-4 minutes on one H200
    python bench/gpu_train_full_shape.py --memory-budget 15GB --activation-checkpointing --grad-accum 4 \
        --seq-lens 2048 --compile off     # one 80 GB card capped as a rank beside vLLM on a 96 GB card
    python bench/gpu_train_full_shape.py --device cpu --draft-config SMALL.json --seq-lens 256 --compile off
        # a dry run of the plumbing on CPU with a small draft config (hidden size from the file)

`--memory-budget SIZE` caps this process's CUDA memory (`torch.cuda.set_per_process_memory_fraction`)
at what one of `--budget-ranks` FSDP ranks (default 8) would have: SIZE plus what this single process
holds whole and such a rank holds 1/R of (weights, gradients, optimizer state and frozen weights, less
the bf16 units FSDP keeps gathered: planned, and printed). A case that runs out of memory under the
cap is reported as such. `--activation-checkpointing` and `--grad-accum N` are 04's flags (N packed
batches per optimizer step; `--steps` counts optimizer steps). On CPU the peak is measured by
common/train/memory_plan.py's PeakTracker (exact, and slow), on a GPU by the allocator's
`max_memory_allocated`; the plan is the eager step's (a compiled forward keeps other tensors).

Needs only `pip install -r requirements.txt` (no vLLM, no Kimi-K2.5 checkpoint): a stand-in target
folder (a Kimi-shaped text config with yarn rope, and only the two tensors the draft reads,
embed_tokens and lm_head, in bf16) is written to --out first. The first two steps of each case
(compilation, allocator warm-up) are not timed.

MFU counts the model's FLOPs per token: 6 x (the weights of the decoder layer(s) and the draft
lm_head) per TTT step (4 x for a frozen lm_head: no weight gradient), 6 x fc's once, 12 x layers x
heads x head_dim x the mean attended length per TTT step (causal within each packed sample), and
2 x hidden x draft vocabulary for the verifier's logits (no gradient). The 8-GPU epochs assume
data-parallel scaling (each rank its own packed sequences, FSDP's all-gathers hidden by the step):
an upper bound on the speed of 8 ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from common.atomic import write_json
from common.draft import patch
from common.draft.model import KIMI_CONFIG, build_draft, read_config_file, speculator_config
from common.miniatures.targets import KIMI_TEXT_CONFIG, KIMI_VOCAB_SIZE
from common.target.config import load_target_info
from common.target.device_plan import parse_size
from common.train.memory_plan import DraftDims, PeakTracker, TrainSetup, peak_memory, static_terms
from common.train.settings import PRECISIONS, TrainSettings
from common.train.trainer import ProjectTrainer, prepare_draft, trainer_config
from common.vocab import build_maps

WARMUP_STEPS = 2
SAMPLES_PER_SEQ_TOKENS = 2048  # packed samples of this length (the 1,000 / 500K estimate's sample)
EPOCH_SAMPLES = (1_000, 500_000)
GPUS = 8
# Dense bf16 tensor-core peaks (TFLOPS, no sparsity) by device name; --peak-tflops for others.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0, "H20": 148.0,
                    "B200": 2250.0, "B300": 2250.0, "GB200": 2500.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
# Kimi-K2.5's text config (README, "Kimi-K2.5 on an 8-GPU host"), flat, as the draft sees it; hidden size from the draft config.
STANDIN_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
    "num_attention_heads": 64, "vocab_size": KIMI_VOCAB_SIZE, "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "rope_scaling": KIMI_TEXT_CONFIG["rope_scaling"], "max_position_embeddings": 262144,
    "pad_token_id": 163839, "tie_word_embeddings": False,
}


def write_standin_target(folder: Path, hidden: int, device: torch.device, vocab: int = KIMI_VOCAB_SIZE) -> Path:
    """config.json plus model.safetensors holding only embed_tokens and lm_head (bf16), of `vocab` rows
    (Kimi-K2.5's 163,840 unless a scaled shape asks for fewer)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**STANDIN_CONFIG, "hidden_size": hidden, "vocab_size": vocab,
                                                    "pad_token_id": vocab - 1}))
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {name: (torch.randn(vocab, hidden, generator=g, device=device) * 0.02).bfloat16().cpu()
               for name in ("model.embed_tokens.weight", "lm_head.weight")}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def synthetic_batches(steps: int, seq_len: int, hidden: int, vocab: int = 150_000) -> list[dict]:
    """Collated batches as 04's loader makes them: [1, seq_len, ...], packed samples of up to
    `SAMPLES_PER_SEQ_TOKENS` tokens, the states in fp32 as the loader hands them over; token ids
    below `vocab`."""
    g = torch.Generator().manual_seed(0)
    n = max(1, seq_len // SAMPLES_PER_SEQ_TOKENS)
    lengths = torch.full((n,), seq_len // n, dtype=torch.long)
    lengths[-1] += seq_len - int(lengths.sum())
    positions = torch.cat([torch.arange(int(k)) for k in lengths]).unsqueeze(0)
    return [{"hidden_states": torch.randn(1, seq_len, 3 * hidden, generator=g),
             "input_ids": torch.randint(0, vocab, (1, seq_len), generator=g),
             "verifier_last_hidden_states": torch.randn(1, seq_len, hidden, generator=g),
             "loss_mask": torch.ones(1, seq_len, dtype=torch.long), "lengths": lengths,
             "position_ids": positions} for _ in range(steps)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TimedBatches:
    """`count` batches for the Trainer's epoch, recording when each step asks for its batch. Made
    ahead (`ahead`: no batch-making in the timed steps) or each when asked (one in memory at a time,
    as the loader hands them over)."""

    batch_sampler = SimpleNamespace(skip=0)  # what ProjectTrainer sets before an epoch

    def __init__(self, count: int, seq_len: int, hidden: int, vocab: int = KIMI_VOCAB_SIZE, ahead: bool = True) -> None:
        self.count, self.shape = count, (seq_len, hidden, vocab)
        self.made = synthetic_batches(count, *self.shape) if ahead else None
        self.times: list[float] = []

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict]:
        self.times = []
        for i in range(self.count):
            batch = self.made[i] if self.made is not None else synthetic_batches(1, *self.shape)[0]
            _sync()
            self.times.append(time.perf_counter())
            yield batch
        _sync()
        self.times.append(time.perf_counter())


def flops_per_token(model: torch.nn.Module, seq_len: int, samples_per_seq: int, ttt_steps: int) -> float:
    """The model FLOPs of one trained token (module docstring)."""
    layer_config = model.config.transformer_layer_config
    layers = sum(p.numel() for p in model.layers.parameters() if p.ndim == 2)
    head = model.lm_head.weight.numel() * (6 if model.lm_head.weight.requires_grad else 4)
    attended = seq_len / samples_per_seq / 2  # causal, within a packed sample (+ the draft diagonal, negligible)
    attention = 12 * layer_config.num_hidden_layers * layer_config.num_attention_heads * layer_config.head_dim
    per_step = 6 * layers + head + attention * attended
    return 6 * model.fc.weight.numel() + ttt_steps * per_step + 2 * model.verifier_lm_head.weight.numel()


@dataclass
class Case:
    seq_len: int
    compiled: bool
    precision: str
    activation_checkpointing: bool
    grad_accum: int
    ms_per_step: float  # per optimizer step (grad_accum packed batches)
    optimizer_ms_per_step: float
    optimizer_share: float  # of the step's time
    tokens_per_s: float
    tflops: float
    mfu: float | None
    peak_memory_gib: float | None
    planned_memory_gib: float  # common/train/memory_plan.py's peak for this process's step
    planned_phase: str
    memory_cap_gib: float | None  # --memory-budget's cap, as set
    out_of_memory: bool
    epoch_hours_8_gpus: dict  # samples -> hours


def planned_setup(settings: TrainSettings, device: torch.device, ranks: int = 1) -> TrainSetup:
    """The memory plan's setup of this process's step (one process) or of one of `ranks` FSDP ranks."""
    bf16 = settings.autocast_dtype(device) is not None
    return TrainSetup(total_seq_len=settings.total_seq_len, ttt_steps=settings.ttt_steps, ranks=ranks,
                      optimizer=settings.optimizer, precision="bf16" if bf16 else "fp32", device=device.type,
                      checkpointing=settings.activation_checkpointing, grad_accum=settings.grad_accum)


def whole_state_excess(dims: DraftDims, settings: TrainSettings, device: torch.device, ranks: int) -> int:
    """Bytes one process holds whatever the pack beyond what one of `ranks` FSDP ranks holds."""
    def held(setup: TrainSetup) -> int:
        s = static_terms(dims, setup)
        return s.weights + s.gradients + s.optimizer_state + s.frozen + s.gathered
    return held(planned_setup(settings, device)) - held(planned_setup(settings, device, ranks))


def set_memory_cap(budget: int | None, excess: int, device: torch.device) -> int | None:
    """Cap this process's CUDA memory at `budget` + `excess` (None: no cap, or not a GPU)."""
    if budget is None or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    cap = min(total, budget + excess)
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return cap


def run_case(args: argparse.Namespace, target: Path, seq_len: int, compiled: bool, peak: float | None) -> Case:
    device = torch.device(args.device)
    config_file = read_config_file(args.draft_config)
    hidden = config_file.model.hidden_size
    info = load_target_info(target, trust_remote_code=True)
    settings, _ = TrainSettings.resolve(config_file, {"total_seq_len": seq_len, "scheduler": "none",
                                                      "precision": args.precision, "epochs": 1,
                                                      "activation_checkpointing": args.activation_checkpointing,
                                                      "grad_accum": args.grad_accum})
    patch.apply(compile_forward=compiled, loss=settings.loss, target_temperature=settings.target_temperature,
                activation_checkpointing=settings.activation_checkpointing)
    counts = torch.arange(KIMI_VOCAB_SIZE, 0, -1)  # any fixed choice of the draft vocabulary
    d2t, t2d = build_maps(counts, config_file.model.draft_vocab_size)
    config = speculator_config(config_file.model, info, d2t.numel(), [2, 30, 58], settings.ttt_steps)
    dims = DraftDims.of(config_file.model, KIMI_VOCAB_SIZE, d2t.numel())
    planned = peak_memory(dims, planned_setup(settings, device))
    cap = set_memory_cap(args.memory_budget, whole_state_excess(dims, settings, device, args.budget_ranks), device)
    torch.manual_seed(0)
    model = build_draft(config, t2d, d2t)
    prepare_draft(model, settings)
    batches_per_step = settings.grad_accum
    batches = TimedBatches((args.steps + WARMUP_STEPS) * batches_per_step, seq_len, hidden, ahead=device.type == "cuda")
    samples_per_seq = max(1, seq_len // SAMPLES_PER_SEQ_TOKENS)
    flops = flops_per_token(model, seq_len, samples_per_seq, settings.ttt_steps)
    trainer = ProjectTrainer(model, trainer_config(settings, args.out / "checkpoints", False, False, device),
                             settings, batches, None, None)
    optimizer_seconds: list[float] = []
    step = trainer.opt.step

    def timed_step(*a, **k):
        _sync()
        start = time.perf_counter()
        result = step(*a, **k)
        _sync()
        optimizer_seconds.append(time.perf_counter() - start)
        return result

    trainer.opt.step = timed_step
    tracker = PeakTracker() if device.type == "cpu" else None
    out_of_memory = False
    try:
        if tracker is not None:
            tracker.track(model.parameters(), model.buffers())
            with tracker:
                trainer.train_epoch(0)
        else:
            torch.cuda.reset_peak_memory_stats()
            trainer.train_epoch(0)
    except torch.OutOfMemoryError:
        out_of_memory = True
    if tracker is not None:
        peak_memory_bytes = tracker.peak
    else:
        peak_memory_bytes = torch.cuda.max_memory_allocated()
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    timed = [b - a for a, b in zip(batches.times[WARMUP_STEPS * batches_per_step:],
                                   batches.times[WARMUP_STEPS * batches_per_step + 1:])]
    seconds = sum(timed) if timed and not out_of_memory else float("nan")
    rate = seq_len * len(timed) / seconds if timed and not out_of_memory else 0.0
    step_ms = 1000 * seconds / args.steps
    optimizer_ms = 1000 * statistics.median(optimizer_seconds[WARMUP_STEPS:]) if len(optimizer_seconds) > WARMUP_STEPS \
        else float("nan")
    tflops = flops * rate / 1e12
    return Case(seq_len, compiled, args.precision, settings.activation_checkpointing, settings.grad_accum, step_ms,
                optimizer_ms, optimizer_ms / step_ms if step_ms else float("nan"), rate, tflops,
                tflops / peak if peak else None, peak_memory_bytes / 2**30, planned.total / 2**30, planned.phase,
                cap / 2**30 if cap is not None else None, out_of_memory,
                {n: n * SAMPLES_PER_SEQ_TOKENS / (GPUS * rate) / 3600 if rate else float("nan") for n in EPOCH_SAMPLES})


def bf16_peak(device: torch.device, given: float | None) -> float | None:
    """TFLOPS: --peak-tflops, else the table's entry for the device name (None if unknown)."""
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


def table(cases: list[Case], where: str, peak: float | None) -> str:
    rows = [f"{where}; dense bf16 peak {f'{peak:g} TFLOPS' if peak else 'unknown (--peak-tflops)'}",
            f"{'tokens':>6} {'accum':>5} {'ckpt':>4} {'compile':>7} {'ms/step':>8} {'optim.':>6} {'tok/s':>9} "
            f"{'TFLOPS':>7} {'MFU':>6} {'peak GiB':>8} {'planned':>7} {'cap':>5}  epoch on {GPUS} GPUs: "
            + ", ".join(f"{n:,} x {SAMPLES_PER_SEQ_TOKENS}" for n in EPOCH_SAMPLES)]
    for c in cases:
        mfu = f"{c.mfu:.1%}" if c.mfu is not None else "-"
        memory = f"{c.peak_memory_gib:.2f}" if c.peak_memory_gib is not None else "-"
        cap = f"{c.memory_cap_gib:.1f}" if c.memory_cap_gib is not None else "-"
        if c.out_of_memory:
            rows.append(f"{c.seq_len:>6} {c.grad_accum:>5} {'on' if c.activation_checkpointing else 'off':>4} "
                        f"{'on' if c.compiled else 'off':>7}  out of memory under the cap of {cap} GiB "
                        f"(peak {memory} GiB, planned {c.planned_memory_gib:.2f} GiB)")
            continue
        epochs = ", ".join(f"{h * 60:.1f} min" if h < 1 else f"{h:.1f} h" for h in c.epoch_hours_8_gpus.values())
        rows.append(f"{c.seq_len:>6} {c.grad_accum:>5} {'on' if c.activation_checkpointing else 'off':>4} "
                    f"{'on' if c.compiled else 'off':>7} {c.ms_per_step:>8.0f} {c.optimizer_share:>6.1%} "
                    f"{c.tokens_per_s:>9,.0f} {c.tflops:>7.1f} {mfu:>6} {memory:>8} {c.planned_memory_gib:>7.2f} "
                    f"{cap:>5}  {epochs}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--compile", choices=("both", "on", "off"), default="both")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case (after 2 untimed)")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="04's --precision")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak (default: from its name; H200/H100 SXM 989)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu04"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--draft-config", type=Path, default=KIMI_CONFIG)
    parser.add_argument("--json", type=Path, default=None, help="write the cases here")
    parser.add_argument("--memory-budget", type=parse_size, default=None,
                        help="a rank's memory, e.g. 15GB: cap this process as one of --budget-ranks FSDP ranks (above)")
    parser.add_argument("--budget-ranks", type=int, default=GPUS, help="the ranks --memory-budget is one of")
    parser.add_argument("--activation-checkpointing", action="store_true", help="04's --activation-checkpointing")
    parser.add_argument("--grad-accum", type=int, default=1, help="04's --grad-accum (packed batches per step)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA device (a dry run on CPU: --device cpu with a small --draft-config)")
    compile_modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.compile]
    if device.type != "cuda":
        compile_modes = (False,)  # compiling the forward on CPU costs minutes and is never used there
    peak = bf16_peak(device, args.peak_tflops)
    target = write_standin_target(args.out / "target", read_config_file(args.draft_config).model.hidden_size, device)
    cases = []
    for seq_len in args.seq_lens:
        for compiled in compile_modes:
            cases.append(run_case(args, target, seq_len, compiled, peak))
            print(table(cases[-1:], "", peak).splitlines()[-1], flush=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(table(cases, f"{where}, precision {args.precision}, {args.steps} timed steps per case", peak))
    if args.json is not None:
        write_json(args.json, {"device": where, "peak_tflops": peak, "memory_budget": args.memory_budget,
                               "budget_ranks": args.budget_ranks, "cases": [asdict(c) for c in cases]})
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
