"""04 --online on one host, computed: what each GPU holds for the hidden-state server (vLLM, tensor
parallel over the host's GPUs) and for the trainer rank beside it, the training layout that fits, and
the rate to expect. scripts/plan_kimi_k25.py --online prints it.

    share = vllm_share(weights_per_gpu, text_config, gpus=8)
    layout = search_layout(CARDS["rtx-pro-6000"], share, DraftDims.kimi_k25(), ranks=8)

- vLLM's share: the target's weights as each tensor-parallel rank holds them (`tensor_parallel_weights`:
  most split over the ranks, MLA's compressed projections and the routers replicated, as vLLM's
  DeepSeek-V2 model builds them), plus an engine sized for a server that only prefills
  (`VllmSettings`): no CUDA graphs (`--enforce-eager`: graphs speed up decoding, which it never does),
  a KV cache of two prefill batches of MLA's compressed KV (`--kv-cache-memory-bytes`), the prefill
  batch's activations (`--max-num-batched-tokens`) and the runtime (CUDA context, NCCL). vLLM's own
  knob is a share of the GPU (`--gpu-memory-utilization`); the share these settings come to is printed
  beside them, for scripts/serve_hidden_states.py, which takes that knob.
- The trainer's share: common/train/memory_plan.py's peak per rank, plus its runtime and the caching
  allocator's slack (`TrainerShare`).
- The layout (`search_layout`): the largest pack (powers of two from 8,192 down) whose step fits beside
  vLLM with `SPARE` of each GPU left over, without activation checkpointing where that fits (it costs a
  third more compute), the rest of `MIN_TOKENS_PER_STEP` per rank made up by --grad-accum.
- The rate (`Rates`): the target's prefill and the draft's training per token, each the slower of its
  compute (FLOPs at an assumed share of the bf16 peak) and its communication (vLLM's tensor-parallel
  all-reduces, FSDP's gathers and reduce-scatters, at an assumed bus bandwidth), the two sharing the
  GPUs one after the other (no overlap assumed between them).

Estimates, not measurements: bench/gpu_train_full_shape.py measures the draft's step on a GPU, and
bench/bench_04_memory.py how close the trainer-memory model is to a measured step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from common.target.int4_experts import PackedLinear
from common.train.memory_plan import DraftDims, MemoryBreakdown, TrainSetup, peak_memory

SPARE = 0.10  # of each GPU left free by the layout: fragmentation, peaks the model does not see
LOW_SPARE = 0.05  # the least spare a layout is offered with when none keeps SPARE
MIN_TOKENS_PER_STEP = 8192  # per rank and optimizer step (speculators' Kimi example trains 8,192-token packs)
PACKS = (8192, 4096, 2048, 1024, 512)
TRAINER_RUNTIME = 1.0e9  # a trainer rank's CUDA context and NCCL communicators: no tensor shows them
VLLM_RUNTIME = 1.0e9  # the same for a vLLM worker (vLLM counts it in its share as non-torch memory)
ALLOCATOR_SLACK = 0.05  # of the trainer's peak: the caching allocator's blocks that fit no request
TRAIN_MFU, PREFILL_MFU = 0.40, 0.30  # assumed shares of the bf16 peak: the draft's dense step, vLLM's INT4 MoE prefill
KIMI_ACTIVE_PARAMS = 32e9  # Kimi-K2.5's activated parameters per token (its model card)
SAMPLE_TOKENS = 2048  # the 500K run's conversations (01 --max-len 2048): attention's reach within a pack
RUN_TOKENS = 500_000 * SAMPLE_TOKENS * 3  # 500K conversations of 2,048 tokens, 3 epochs
# Tensors each vLLM tensor-parallel rank holds whole (vLLM's DeepSeek-V2/V3 model: the MLA down-projections
# and their norms are replicated linears, as are the routers and every layer norm).
REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "layernorm", "norm.weight", "mlp.gate.weight",
              "e_score_correction_bias")


@dataclass(frozen=True)
class Card:
    name: str
    memory: int  # bytes, as the driver reports the card's total (nvidia-smi)
    bf16_peak: float  # dense FLOPs/s
    bus_bandwidth: float  # bytes/s a rank's NCCL collectives move (assumed: NVLink or PCIe)


CARDS = {
    "h200": Card("8 x H200 (141 GB, NVLink; 989 TFLOPs bf16 dense)", 141_000_000_000, 989e12, 300e9),
    # sold as 96 GB; the driver reports 97,887 MiB
    "rtx-pro-6000": Card("8 x RTX PRO 6000 Blackwell (96 GB = 97,887 MiB, PCIe; ~500 TFLOPs bf16 dense)",
                         97_887 * 2**20, 500e12, 30e9),
}


# --- vLLM's share ---

def tensor_parallel_weights(model: torch.nn.Module, tp: int) -> tuple[int, int]:
    """(bytes per rank, of which replicated) of `model`'s weights under vLLM's tensor parallelism over
    `tp` ranks: packed and integer tensors at their own size, floating ones in bf16 (as
    `common.target.device_plan.block_sizes` counts them), `REPLICATED` ones whole on every rank."""
    split = replicated = 0
    for module_name, module in model.named_modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            keep = isinstance(module, PackedLinear) or not t.dtype.is_floating_point
            size = t.numel() * (t.element_size() if keep else 2)
            if any(pattern in f"{module_name}.{name}" for pattern in REPLICATED):
                replicated += size
            else:
                split += size
    return split // tp + replicated, replicated


@dataclass(frozen=True)
class VllmSettings:
    """A prefill-only hidden-state server's engine settings."""

    max_num_batched_tokens: int = 4096  # the prefill batch: 2 conversations of 2,048 tokens
    max_model_len: int = SAMPLE_TOKENS  # the longest sample; the server asks vLLM for one token more
    max_num_seqs: int = 16

    @property
    def kv_tokens(self) -> int:
        return 2 * self.max_num_batched_tokens  # the batch prefilling and the next one admitted

    def flags(self, kv_cache_bytes: int) -> str:
        """scripts/serve_hidden_states.py's flags (its --max-model-len is the longest sample's tokens)."""
        return (f"--enforce-eager --max-num-batched-tokens {self.max_num_batched_tokens} "
                f"--max-num-seqs {self.max_num_seqs} --max-model-len {self.max_model_len} "
                f"--kv-cache-memory-bytes {kv_cache_bytes}")


@dataclass(frozen=True)
class VllmShare:
    settings: VllmSettings
    weights: int
    replicated: int
    kv_cache: int
    activations: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.runtime

    def utilization(self, card: Card) -> float:
        """vLLM's `--gpu-memory-utilization` that leaves it this much: its budget is that share of the
        card, for weights, the profiled activations, non-torch memory and the KV cache."""
        return math.ceil(100 * self.total / card.memory) / 100


def mla_kv_bytes_per_token(text_config) -> int:
    """MLA caches one compressed KV (kv_lora_rank + the rope dims) per layer, bf16, whole on each rank."""
    c = text_config
    return c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2


def prefill_activation_bytes_per_token(text_config, tp: int) -> int:
    """vLLM's prefill activations per batched token on one rank, bf16: the residual stream and its
    norms, attention and MoE in/out and all-reduce buffers (8 x hidden), the fused-MoE kernel's
    per-expert output cache (top-k x hidden) and gate/up cache (top-k x 2 x the rank's slice of the
    expert width), and the four extracted hidden states."""
    c = text_config
    per_token = (8 * c.hidden_size + c.num_experts_per_tok * c.hidden_size
                 + c.num_experts_per_tok * 2 * c.moe_intermediate_size // tp + 4 * c.hidden_size)
    return 2 * per_token


def vllm_share(weights: tuple[int, int], text_config, tp: int, settings: VllmSettings = VllmSettings()) -> VllmShare:
    per_gpu, replicated = weights
    return VllmShare(settings, per_gpu, replicated, settings.kv_tokens * mla_kv_bytes_per_token(text_config),
                     settings.max_num_batched_tokens * prefill_activation_bytes_per_token(text_config, tp), VLLM_RUNTIME)


# --- the trainer's share and the layout ---

@dataclass(frozen=True)
class TrainerShare:
    setup: TrainSetup
    peak: MemoryBreakdown

    @property
    def slack(self) -> int:
        return int(ALLOCATOR_SLACK * self.peak.total)

    @property
    def total(self) -> int:
        return self.peak.total + self.slack + TRAINER_RUNTIME


def trainer_share(dims: DraftDims, setup: TrainSetup) -> TrainerShare:
    return TrainerShare(setup, peak_memory(dims, setup))


def gpu_setup(total_seq_len: int, ranks: int, grad_accum: int = 1, checkpointing: bool = False) -> TrainSetup:
    """04 on GPUs under torchrun: FSDP over `ranks`, bf16 autocast, Muon, 3 TTT steps."""
    return TrainSetup(total_seq_len=total_seq_len, ranks=ranks, precision="bf16", device="cuda",
                      checkpointing=checkpointing, grad_accum=grad_accum)


@dataclass(frozen=True)
class Layout:
    card: Card
    vllm: VllmShare | None  # None: the trainer alone on the host
    trainer: TrainerShare

    @property
    def used(self) -> int:
        return (self.vllm.total if self.vllm else 0) + self.trainer.total

    @property
    def spare(self) -> float:
        return 1 - self.used / self.card.memory

    def fits(self, spare: float = SPARE) -> bool:
        return self.spare >= spare

    @property
    def tokens_per_step(self) -> int:
        """Per rank and optimizer step."""
        return self.trainer.setup.total_seq_len * self.trainer.setup.grad_accum


def candidates(ranks: int, min_tokens: int = MIN_TOKENS_PER_STEP) -> list[TrainSetup]:
    """Largest pack first, plain before checkpointed, accumulation making up `min_tokens` per rank."""
    return [gpu_setup(pack, ranks, max(1, -(-min_tokens // pack)), checkpointing)
            for pack in PACKS for checkpointing in (False, True)]


def search_layout(card: Card, vllm: VllmShare | None, dims: DraftDims, ranks: int,
                  setups: list[TrainSetup] | None = None, spare: float = SPARE) -> Layout | None:
    """The first of `setups` (default `candidates`) that fits beside `vllm` with `spare` left, or None."""
    for setup in setups or candidates(ranks):
        layout = Layout(card, vllm, trainer_share(dims, setup))
        if layout.fits(spare):
            return layout
    return None


def what_to_change(card: Card, vllm: VllmShare, dims: DraftDims, ranks: int) -> tuple[list[str], Layout | None]:
    """When no layout fits: the changes that would make one, each with what it gives up, and the layout
    that fits as 04 stands (fewer tokens per optimizer step), if any."""
    lines = []
    fallback = search_layout(card, vllm, dims, ranks, [replace(s, grad_accum=1) for s in candidates(ranks)])
    if fallback is not None:
        s = fallback.trainer.setup
        lines.append(f"fewer tokens per optimizer step: {train_flags(s)} fits ({fallback.spare:.0%} spare) at "
                     f"{s.total_seq_len:,} tokens per rank per step (below)")
    tight = search_layout(card, vllm, dims, ranks, spare=LOW_SPARE)
    if tight is not None:
        lines.append(f"less spare: {train_flags(tight.trainer.setup)} leaves {tight.spare:.1%} of each GPU "
                     f"({tight.used / 1e9:.1f} GB of {card.memory / 1e9:.1f} GB), the largest pack above "
                     f"{LOW_SPARE:.0%}")
    lines.append("the trainer on a second host (two hosts, below)")
    return lines, fallback


def train_flags(setup: TrainSetup) -> str:
    flags = f"--total-seq-len {setup.total_seq_len} --grad-accum {setup.grad_accum}"
    return flags + (" --activation-checkpointing" if setup.checkpointing else "")


# --- the rate ---

def draft_flops_per_token(dims: DraftDims, setup: TrainSetup, sample_tokens: int = SAMPLE_TOKENS) -> float:
    """Training FLOPs of one token: per TTT step the layers' and lm_head's matmuls (2 forward, 4 backward,
    2 more when checkpointing recomputes them), the verifier's logits (forward, and recomputed), attention
    over half a sample on average (causal within each packed sample: 4 forward, 8 backward, 4 recomputed
    per head dimension and key); fc's once."""
    recompute = 2 if setup.checkpointing else 0
    layers = sum(sum(dims.layer_matrices(i == 0)) for i in range(dims.layers))
    attention = dims.layers * dims.q_width * min(sample_tokens, setup.total_seq_len) / 2
    per_step = ((6 + recompute) * (layers + dims.lm_head) + (2 + recompute) * dims.verifier_head
                + (12 + 2 * recompute) * attention)
    return 6 * dims.fc + setup.ttt_steps * per_step


def fsdp_bytes_per_pack(dims: DraftDims, setup: TrainSetup) -> float:
    """Bytes a rank's FSDP collectives move per packed batch (a ring moves (R - 1) / R of each): the
    layers gathered in bf16 at each TTT step's forward and again for its backward (resharded after each),
    the embedding once (checkpointed: the steps read the dataset's tokens) or at each step (the library's
    forward), the verifier lm_head and the root unit once; the gradients reduce-scattered in fp32 once
    per batch, each unit's (autograd sums a layer's over the TTT steps before FSDP sees them;
    common/train/memory_plan.py's `Step`), into the sharded gradient a --grad-accum group adds up."""
    r = setup.ranks
    layers = sum(dims.layer_params(i) for i in range(dims.layers))
    lookups = 1 if setup.checkpointing else setup.ttt_steps
    gathers = 2 * (2 * setup.ttt_steps * layers + lookups * dims.embedding + dims.verifier_head + dims.root_unit)
    scatters = 4 * (layers + dims.root_unit)
    return (r - 1) / r * (gathers + scatters)


def tp_allreduce_bytes_per_token(text_config, tp: int) -> float:
    """vLLM's tensor-parallel all-reduces per prefilled token and rank: two per layer (attention's
    output projection, the MoE's output) of the hidden state in bf16, a ring moving 2 (R - 1) / R."""
    return text_config.num_hidden_layers * 2 * text_config.hidden_size * 2 * 2 * (tp - 1) / tp


@dataclass(frozen=True)
class Rates:
    prefill: float  # tokens/s of the target's prefill over the host's GPUs
    train: float  # tokens/s of the draft's training over the host's ranks
    prefill_bound: str
    train_bound: str

    @property
    def shared(self) -> float:
        """One host, the two taking turns on each GPU."""
        return 1 / (1 / self.prefill + 1 / self.train)

    @property
    def two_hosts(self) -> float:
        return min(self.prefill, self.train)


def rates(card: Card, dims: DraftDims, setup: TrainSetup, text_config, gpus: int) -> Rates:
    prefill_compute = gpus * card.bf16_peak * PREFILL_MFU / (2 * KIMI_ACTIVE_PARAMS)
    prefill_comm = card.bus_bandwidth / tp_allreduce_bytes_per_token(text_config, gpus)
    rank_compute = card.bf16_peak * TRAIN_MFU / draft_flops_per_token(dims, setup)
    rank_comm = card.bus_bandwidth * setup.total_seq_len / fsdp_bytes_per_pack(dims, setup)
    return Rates(min(prefill_compute, prefill_comm), setup.ranks * min(rank_compute, rank_comm),
                 "compute" if prefill_compute <= prefill_comm else "all-reduces",
                 "compute" if rank_compute <= rank_comm else "FSDP collectives")


def hours(tokens_per_s: float, tokens: float = RUN_TOKENS) -> float:
    return tokens / tokens_per_s / 3600


# --- the printed plan ---

def describe_host(card: Card, vllm: VllmShare, dims: DraftDims, text_config, gpus: int) -> list[str]:
    """The one-host online plan of `card`: vLLM's share, the layout that fits (or what to change, and the
    layout that fits with fewer tokens per step), the breakdown of the trainer's peak, the rate, and the
    trainer alone on a second host."""
    lines = [f"{card.name}:",
             f"  vLLM TP{gpus} (prefill-only hidden-state server): {vllm.total / 1e9:.1f} GB per GPU = "
             f"{vllm.weights / 1e9:.1f} GB weights ({vllm.replicated / 1e9:.1f} GB of them replicated) + "
             f"{vllm.kv_cache / 1e9:.2f} GB KV ({vllm.settings.kv_tokens:,} tokens of MLA's compressed KV) + "
             f"{vllm.activations / 1e9:.2f} GB prefill activations + {vllm.runtime / 1e9:.1f} GB runtime",
             f"    vLLM flags: {vllm.settings.flags(vllm.kv_cache)}",
             f"    as a share: --gpu-memory-utilization {vllm.utilization(card):.2f} "
             f"(scripts/serve_hidden_states.py's flag)"]
    layout = search_layout(card, vllm, dims, gpus)
    if layout is None:
        changes, layout = what_to_change(card, vllm, dims, gpus)
        lines.append(f"  trainer: no pack fits beside vLLM with {SPARE:.0%} of {card.memory / 1e9:.1f} GB spare at "
                     f"{MIN_TOKENS_PER_STEP:,} tokens per rank per step: does NOT fit. What to change:")
        lines += [f"    - {line}" for line in changes]
    if layout is not None:
        lines += describe_layout(layout, gpus)
    setup = layout.trainer.setup if layout is not None else gpu_setup(PACKS[0], gpus)
    r = rates(card, dims, setup, text_config, gpus)
    lines.append(f"  rate: prefill ~{r.prefill:,.0f} tokens/s (bound by {r.prefill_bound}), training "
                 f"~{r.train:,.0f} tokens/s (bound by {r.train_bound}); one host ~{r.shared:,.0f} tokens/s: "
                 f"500K x 2,048 tokens x 3 epochs in ~{hours(r.shared):.0f} h")
    alone = search_layout(card, None, dims, gpus)  # the trainer with a host to itself
    if alone is not None:
        r2 = rates(card, dims, alone.trainer.setup, text_config, gpus)
        lines.append(f"  two hosts (vLLM on one; the trainer on the other, {train_flags(alone.trainer.setup)}, "
                     f"{alone.trainer.total / 1e9:.1f} GB per GPU): ~{r2.two_hosts:,.0f} tokens/s, "
                     f"~{hours(r2.two_hosts):.0f} h")
    return lines


def describe_layout(layout: Layout, gpus: int) -> list[str]:
    setup, t = layout.trainer.setup, layout.trainer
    tokens = setup.total_seq_len * setup.grad_accum
    return [f"  trainer (torchrun, {gpus} ranks, FSDP): {train_flags(setup)}: {tokens:,} tokens per rank per step "
            f"({tokens * gpus:,} per step); {t.total / 1e9:.1f} GB per GPU = {t.peak.total / 1e9:.2f} GB peak + "
            f"{t.slack / 1e9:.2f} GB allocator slack + {TRAINER_RUNTIME / 1e9:.1f} GB runtime",
            f"  per GPU: {layout.used / 1e9:.1f} GB of {layout.card.memory / 1e9:.1f} GB, {layout.spare:.0%} spare: fits",
            "  the trainer's peak per rank:",
            *[f"    {line}" for line in t.peak.lines()]]


def assumptions(cards: list[Card]) -> str:
    buses = ", ".join(f"{c.name.split(' (')[0]} {c.bus_bandwidth / 1e9:.0f} GB/s" for c in cards)
    return (f"assumed: draft training at {TRAIN_MFU:.0%} and the target's prefill at {PREFILL_MFU:.0%} of the bf16 "
            f"peak; collectives at {buses} per rank; {SPARE:.0%} of each GPU spare; a trainer rank's runtime "
            f"{TRAINER_RUNTIME / 1e9:.0f} GB and {ALLOCATOR_SLACK:.0%} allocator slack")
