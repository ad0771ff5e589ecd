"""The memory one rank of 04's training holds at its peak, term by term, and a tracker that measures it.

    from common.train.memory_plan import DraftDims, TrainSetup, peak_memory
    plan = peak_memory(DraftDims.kimi_k25(), TrainSetup(total_seq_len=4096, ranks=8, precision="bf16",
                                                        device="cuda", checkpointing=True, grad_accum=2))
    print(plan.total, *plan.lines())

A structural model, not a fit: every term is a tensor the training step holds, counted from the draft's
shape (`DraftDims`) and the run's settings (`TrainSetup`), at each moment where the step's memory can
peak (`phase_breakdowns`); the peak is the largest. bench/bench_04_memory.py measures the same step with
`PeakTracker` at scaled shapes, in one process and under FSDP over one and two gloo ranks, and compares
(docs/kimi_k25.md holds the tables).

Where the bytes go (T tokens per pack, H hidden, V the draft vocabulary, S TTT steps, R ranks):

- Weights, gradients and optimizer state of what trains (fc, the decoder layers, their norms, the draft
  lm_head), fp32, 1/R of each on a rank under FSDP: 4 + 4 bytes per parameter, plus Muon's one momentum
  (4) on the layers' and fc's matrices and AdamW's two moments (8) on the rest. Gradients persist from
  one step into the next forward (04 drops them after the forward; the backward makes new ones); under
  FSDP a rank holds only its share of them, also between a --grad-accum group's batches (each batch's
  are reduce-scattered into it: `ProjectTrainer.train_step`).
- Frozen: the target's embedding (target vocabulary x H) and the verifier lm_head (V x H), built in
  fp32 by the library. Under FSDP each is a unit of its own (`common.train.distributed.shard_draft`):
  1/R at rest; the embedding whole in bf16 only while a forward looks it up (its all-gather output and
  the unsharded copy for a moment), never in the backward.
- Gathered: FSDP keeps the root unit (fc, the draft lm_head, the final norm) and the verifier lm_head
  whole in bf16 from their first call to the end of the backward. A decoder layer is three units, its
  attention and its MLP inside the layer's own (its norms): what FSDP2 holds of them, gathered, kept
  after a gather, and of their gradients, is `Step`'s docstring. In one process under bf16 autocast,
  the casts of the trained weights (cached by autocast) live as long as the graph.
- The batch: T x 4H fp32 states (three auxiliary layers, the last layer) and three int64 rows.
- The verifier's targets: its logits [T x V] and softmax p (kept by `DraftLoss` until the next batch).
- Saved activations, per TTT step and token, counted from the EAGLE-3 first layer (a Llama decoder
  layer reading [embedding, state]) and the loss (`step_saved`): the step's input and the attention
  input (2H each), four RMS norms' inputs and normed values, the residual sums, q and the attention
  output, 4 x intermediate in the SwiGLU MLP, the log-softmax over V, and the keys and values, which
  the cache concatenates: step k saves all (k+1) T of them. On CPUs patch's dense attention mask adds
  T x (k+1) T per step (and stays for the next batch). With --activation-checkpointing
  (common/draft/forward.py) a step keeps only its input state and embeddings, its output normed state
  and its new keys and values, and the backward recomputes one step (and one loss tile) at a time.
- Transient: what lives only around the peak's moment (the last step's logits and the loss product at
  the forward's end, the loss gradients, the loss tiles and the recomputed step under checkpointing;
  under FSDP the layer's parts gathered, the all-gather output FSDP keeps, the layer's gradients summed
  over the TTT steps, the reduce-scatter buffers; the optimizer step's temporaries).

Not counted here but in common/online/host_plan.py's `TrainerShare`: the CUDA context, NCCL's
buffers and the caching allocator's slack, which no tensor shows.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common.draft.forward import TILE_TOKENS
from common.draft.model import DraftShape
from common.train.optimizers import assign_owners, ns_cost

FP32, BF16, INT64 = 4, 2, 8
OPTIMIZERS = ("muon", "adamw")
PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "cuda")
KIMI_K25_TARGET_VOCAB = 163_840  # Kimi-K2.5's vocabulary: the rows of the frozen embedding


# --- the draft and the run ---

@dataclass(frozen=True)
class DraftDims:
    """The shape of an EAGLE-3 draft as the trainer holds it (the library's Llama layers)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    target_vocab: int

    @classmethod
    def of(cls, shape: DraftShape, target_vocab: int, draft_vocab: int | None = None) -> DraftDims:
        """From a draft config's `model` section; `draft_vocab` where the config leaves it to 03."""
        vocab = draft_vocab or shape.draft_vocab_size
        if vocab is None:
            raise ValueError("the draft vocabulary size: the config leaves it to 03, give it")
        return cls(shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads, shape.num_key_value_heads,
                   shape.head_dim, shape.intermediate_size, vocab, target_vocab)

    @classmethod
    def kimi_k25(cls) -> DraftDims:
        """configs/draft_kimi_k25.json's draft on Kimi-K2.5."""
        return cls(7168, 1, 64, 64, 128, 18432, 32_000, KIMI_K25_TARGET_VOCAB)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_matrices(self, first: bool) -> list[int]:
        """Elements of one decoder layer's weight matrices: q, k, v (the first layer reads the 2H
        concatenation of embedding and state), o, gate, up, down."""
        width = 2 * self.hidden if first else self.hidden
        return [width * self.q_width, width * self.kv_width, width * self.kv_width, self.q_width * self.hidden,
                *[self.hidden * self.intermediate] * 3]

    def layer_norms(self, first: bool) -> int:
        return self.hidden * (3 if first else 2)  # input, (EAGLE-3's hidden_norm,) post-attention

    def layer_params(self, index: int) -> int:
        return sum(self.layer_matrices(index == 0)) + self.layer_norms(index == 0)

    def layer_parts(self, index: int) -> list[list[int]]:
        """The FSDP units inside decoder layer `index`, in forward order, as their matrices' elements:
        the attention's (q, k, v, o) and the MLP's (gate, up, down); the norms stay in the layer's own
        unit (`common.train.distributed.shard_draft`)."""
        matrices = self.layer_matrices(index == 0)
        return [matrices[:4], matrices[4:]]

    def matrix_shapes(self) -> list[tuple[int, int]]:
        """(rows, columns) of the matrices Muon steps, as nn.Linear holds them [out x in]: fc's, then each
        layer's q, k, v, o, gate, up, down."""
        shapes = [(self.hidden, 3 * self.hidden)]
        for i in range(self.layers):
            width = 2 * self.hidden if i == 0 else self.hidden
            shapes += [(self.q_width, width), (self.kv_width, width), (self.kv_width, width),
                       (self.hidden, self.q_width), (self.intermediate, self.hidden), (self.intermediate, self.hidden),
                       (self.hidden, self.intermediate)]
        return shapes

    @property
    def fc(self) -> int:
        return 3 * self.hidden * self.hidden

    @property
    def lm_head(self) -> int:
        return self.draft_vocab * self.hidden

    @property
    def muon_params(self) -> int:
        """The matrices Muon steps: the layers' and fc's (`common.train.optimizers.muon_parameters`)."""
        return self.fc + sum(sum(self.layer_matrices(i == 0)) for i in range(self.layers))

    @property
    def trainable(self) -> int:
        return self.fc + self.lm_head + self.hidden + sum(self.layer_params(i) for i in range(self.layers))

    @property
    def root_unit(self) -> int:
        """FSDP's root unit: what is neither a layer nor a frozen unit (fc, lm_head, the final norm)."""
        return self.fc + self.lm_head + self.hidden

    @property
    def embedding(self) -> int:
        return self.target_vocab * self.hidden

    @property
    def verifier_head(self) -> int:
        return self.draft_vocab * self.hidden

    @property
    def largest_matrix(self) -> int:
        return max(self.fc, *self.layer_matrices(True))


@dataclass(frozen=True)
class TrainSetup:
    """How 04 trains: the pack, the TTT steps, the ranks (FSDP above 1), the optimizer, the compute
    (`precision` bf16: autocast, as 04's --precision auto on GPUs; FSDP always gathers bf16 weights),
    the device kind (its attention and autocast differ: `Dtypes`), checkpointing and accumulation."""

    total_seq_len: int
    ttt_steps: int = 3
    ranks: int = 1
    optimizer: str = "muon"
    precision: str = "fp32"
    device: str = "cpu"
    checkpointing: bool = False
    grad_accum: int = 1
    fsdp: bool | None = None  # None: FSDP when ranks > 1 (torchrun); True also for one rank under torchrun

    def __post_init__(self) -> None:
        for name, value, allowed in (("optimizer", self.optimizer, OPTIMIZERS), ("precision", self.precision, PRECISIONS),
                                     ("device", self.device, DEVICES)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: one of {', '.join(allowed)}")
        if min(self.total_seq_len, self.ttt_steps, self.ranks, self.grad_accum) < 1:
            raise ValueError("total_seq_len, ttt_steps, ranks and grad_accum must be at least 1")

    @property
    def sharded(self) -> bool:
        return self.ranks > 1 if self.fsdp is None else self.fsdp


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of each kind of activation, by how the step computes.

    - `matmul`: linear outputs (bf16 under autocast or FSDP's bf16 weights).
    - `stream`: the residual stream between norms. fp32 in one process (the fp32 embedding's output
      promotes the concatenation), bf16 under FSDP (embedding and fc both give bf16).
    - `normed`: what an RMS norm keeps for its weight's gradient (its fp32 result cast to the input's
      dtype); `norm_copy`: the fp32 copy of a bf16 input the norm computes in (none for fp32 input).
    - `softmax`: softmax and log-softmax outputs: fp32, or bf16 from bf16 logits unless CUDA's autocast
      runs them (it runs them in fp32; CPU's autocast does not).
    - `linear_input_copies`: bf16 copies autocast makes of an fp32 input per linear (one process in
      bf16: q, k and v each cast the attention input; under FSDP the input is bf16 already).
    - `attention_output_copies`: FlexAttention saves its [heads, T, d] output and o_proj the
      transposed copy (2); CPU SDPA's output is already in o_proj's layout (1).
    - `dense_mask`: patch's additive CPU mask, in the query's dtype (0 on GPUs: a block mask)."""

    matmul: int
    stream: int
    normed: int
    norm_copy: int
    softmax: int
    linear_input_copies: int
    attention_output_copies: int
    dense_mask: int

    @classmethod
    def of(cls, setup: TrainSetup) -> Dtypes:
        low = setup.precision == "bf16" or setup.sharded
        matmul = BF16 if low else FP32
        stream = BF16 if setup.sharded else FP32
        cpu = setup.device == "cpu"
        return cls(matmul=matmul, stream=stream, normed=stream, norm_copy=FP32 if stream != FP32 else 0,
                   softmax=FP32 if not low or (setup.precision == "bf16" and not cpu) else BF16,
                   linear_input_copies=3 if (low and stream == FP32) else 1,
                   attention_output_copies=1 if cpu else 2, dense_mask=matmul if cpu else 0)


# --- the breakdown ---

@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the step's peak (`phase`), by term (see the module docstring)."""

    phase: str
    weights: int
    gradients: int
    optimizer_state: int
    frozen: int
    gathered: int
    batch: int
    targets: int
    activations: int
    transient: int

    TERMS = ("weights", "gradients", "optimizer_state", "frozen", "gathered", "batch", "targets", "activations",
             "transient")
    LABELS = {"weights": "trained weights (fp32, this rank's share)",
              "gradients": "their gradients (fp32)",
              "optimizer_state": "optimizer state (Muon momentum, AdamW moments)",
              "frozen": "frozen embedding and verifier lm_head (fp32)",
              "gathered": "whole bf16 weights kept through the step",
              "batch": "the batch's states",
              "targets": "the verifier's targets [tokens x draft vocab]",
              "activations": "activations saved for the backward",
              "transient": "transient at the peak's moment"}

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in self.TERMS)

    @property
    def static(self) -> int:
        """What the rank holds whatever the pack: weights, gradients, optimizer state, frozen weights."""
        return self.weights + self.gradients + self.optimizer_state + self.frozen

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"total": self.total}

    def lines(self, unit: float = 1e9, suffix: str = "GB") -> list[str]:
        rows = [f"{self.LABELS[name]:<48} {getattr(self, name) / unit:>8.2f} {suffix}" for name in self.TERMS]
        return [*rows, f"{'peak (' + self.phase + ')':<48} {self.total / unit:>8.2f} {suffix}"]


# --- activations ---

def step_saved(dims: DraftDims, setup: TrainSetup, d: Dtypes) -> int:
    """Bytes per token one TTT step of the plain forward saves for the backward, its keys/values apart
    (`kv_saved`): derived from speculators' EAGLE-3 first layer, transformers' LlamaRMSNorm and
    LlamaAttention, and `common.draft.loss.kl_loss`, one tensor at a time."""
    h = dims.hidden
    norm = d.norm_copy * h + d.normed * h  # an RMS norm: its fp32 input (a copy if bf16), its normed value
    step_input = 2 * h * d.stream if not d.norm_copy else 0  # read by the first two norms; in bf16 their copies
    per_layer = 0
    for i in range(dims.layers):
        width = 2 * h if i == 0 else h
        norms_in = (2 if i == 0 else 1) * norm  # EAGLE-3's input and hidden norms, or the input norm
        attention_in = d.linear_input_copies * width * (d.matmul if d.linear_input_copies > 1 else d.stream)
        residuals = 2 * h * d.stream if not d.norm_copy else 0  # after attention and MLP, read by the next norms
        q_and_out = dims.q_width * d.matmul * (1 + d.attention_output_copies)
        mlp = (norm + 2 * h * d.matmul * (d.linear_input_copies > 1)  # post-attention norm (+ gate/up casts)
               + h * d.normed * (d.linear_input_copies == 1)         # its output, read by gate and up
               + 4 * dims.intermediate * d.matmul)                   # gate, silu(gate), up, their product
        rope = 2 * dims.head_dim * d.stream  # cos and sin
        per_layer += norms_in + attention_in + residuals + q_and_out + mlp + rope
    final = norm + h * (d.matmul if d.linear_input_copies > 1 else d.normed)  # final norm and lm_head's input
    loss = dims.draft_vocab * d.softmax  # the log-softmax kept by the KL's product
    return step_input + per_layer + final + loss


def kv_saved(dims: DraftDims, d: Dtypes, tokens: int, step: int) -> int:
    """Keys and values attention saves at TTT step `step` (0-based): the cache's concatenation of every
    step so far, (step + 1) x tokens rows per layer."""
    return dims.layers * 2 * (step + 1) * tokens * dims.kv_width * d.matmul


def mask_saved(d: Dtypes, tokens: int, step: int) -> int:
    """patch's dense CPU mask SDPA saves at step `step`: [tokens x (step + 1) tokens]."""
    return d.dense_mask * tokens * (step + 1) * tokens


def plain_activations(dims: DraftDims, setup: TrainSetup, d: Dtypes, steps: int) -> int:
    """What the plain forward has saved after `steps` TTT steps."""
    t = setup.total_seq_len
    return sum(step_saved(dims, setup, d) * t + kv_saved(dims, d, t, k) + mask_saved(d, t, k) for k in range(steps))


def checkpoint_kept(dims: DraftDims, setup: TrainSetup, d: Dtypes) -> int:
    """Bytes per token a checkpointed TTT step keeps (common/draft/forward.py): its inputs (the state,
    its tokens' embeddings, looked up outside the step, and its positions), its output normed state
    (the loss tiles' input) and its new keys and values per layer."""
    return 3 * dims.hidden * d.stream + 2 * INT64 + dims.layers * 2 * dims.kv_width * d.matmul


def tile_transient(dims: DraftDims, d: Dtypes, rows: int) -> int:
    """One loss tile (`TILE_TOKENS` rows) at its largest, in the forward and again when the backward
    recomputes it: the draft's logits, the verifier's logits and their copy at the target temperature
    (matmul outputs), its softmax p and the p log p being summed (softmax dtype), [rows x V] each; the
    tile's gradients come after the verifier's logits are gone, and are no larger."""
    return dims.draft_vocab * rows * (3 * d.matmul + 2 * d.softmax)


# --- the phases ---

GATHER_EMBEDDING = "embedding gathered"
GATHER_LAYER = "layer gathered at the last TTT step"
FORWARD_END = "forward end"
BACKWARD_START = "backward start"
LAYER_BACKWARD = "the last TTT step's layer backward"
EARLIER_LAYER_BACKWARD = "an earlier TTT step's layer backward"
REDUCE_SCATTER = "the layer's reduce-scatters"
TILE_RECOMPUTED = "the last TTT step's loss tile recomputed"
EARLIER_TILE_RECOMPUTED = "an earlier TTT step's loss tile recomputed"
LAST_STEP_RECOMPUTED = "the last TTT step recomputed"
STEP_RECOMPUTED = "an earlier TTT step recomputed"
OPTIMIZER_STEP = "optimizer step"


@dataclass(frozen=True)
class Static:
    weights: int
    gradients: int
    optimizer_state: int
    frozen: int
    gathered: int


def static_terms(dims: DraftDims, setup: TrainSetup) -> Static:
    """What the rank holds through the forward, whatever the pack: weights, the step before's gradients
    (under FSDP this rank's share, also between a --grad-accum group's batches: each batch's are
    reduce-scattered into it), optimizer state, frozen weights, and what stays gathered."""
    r = setup.ranks if setup.sharded else 1
    trainable = dims.trainable
    moments = dims.muon_params * FP32 + (trainable - dims.muon_params) * 2 * FP32 if setup.optimizer == "muon" \
        else trainable * 2 * FP32
    if setup.sharded:  # the root unit and the verifier lm_head stay gathered to the end of the backward
        gathered = (dims.root_unit + dims.verifier_head) * BF16
    elif setup.precision == "bf16":
        gathered = trainable * BF16  # autocast's cached casts of the trained weights
    else:
        gathered = 0
    return Static(trainable * FP32 // r, trainable * FP32 // r, moments // r,
                  (dims.embedding + dims.verifier_head) * FP32 // r, gathered)


def collated_bytes(dims: DraftDims, setup: TrainSetup) -> int:
    """The collated batch: states in fp32, input ids, loss mask and positions in int64."""
    t = setup.total_seq_len
    return t * 4 * dims.hidden * FP32 + 3 * t * INT64


def batch_bytes(dims: DraftDims, setup: TrainSetup) -> int:
    """The collated batch on the device (`collated_bytes`); FSDP's root casts the states to bf16 on the
    way in (fc keeps its cast input for its weight's gradient), as does autocast for fc's input in one
    bf16 process."""
    t = setup.total_seq_len
    states = collated_bytes(dims, setup)
    if setup.sharded:
        states += t * 4 * dims.hidden * BF16
    elif setup.precision == "bf16":
        states += t * 3 * dims.hidden * BF16
    return states


@dataclass(frozen=True)
class Step:
    """What the phases of one training step share: the draft, the setup, their dtypes and sizes.

    Under FSDP (`common.train.distributed.shard_draft`, torch's FSDP2) a decoder layer is three units:
    its attention and its MLP (`parts`, in forward order) inside the layer's own unit, which holds only
    its norms. What FSDP2 does with them, and so what the terms below count (R ranks, bf16 weights):

    - A unit's gather allocates its all-gather output (whole), copies it out into the unsharded
      parameters (whole) and, in a forward, keeps the output until the next unit's copy-out is done
      (its implicit prefetch): the previous unit's output, this one's and its unsharded weights for a
      moment (`gather`). The last unit a forward gathers is the MLP; its output stays until the next forward
      gather: through the loss and, in the plain step, the whole backward (`retained`). On one rank
      there is no all-gather buffer: each parameter's bf16 copy is written into the unsharded weights.
    - A checkpointed step's recompute runs inside the backward, where FSDP does not reshard after
      forward, and the backward prefetches the attention while the MLP runs: both parts are whole
      while a layer's backward runs (`gathered_layer`).
    - The TTT steps call the layer S times. Autograd sums a weight's gradients over the S calls before
      it reaches the weight, so FSDP's post-backward finds them only at the first step's backward (the
      last one run): until then each part's gradient is held whole in bf16 (`layer_grads`), then
      reduce-scattered once per batch, part by part (`reduce_scatter`): its bf16 gradients, their fp32
      copy (kept until the next unit's reduce-scatter starts) and this rank's fp32 share, added into
      the sharded gradient."""

    dims: DraftDims
    setup: TrainSetup
    d: Dtypes
    static: Static
    batch: int

    @classmethod
    def of(cls, dims: DraftDims, setup: TrainSetup) -> Step:
        return cls(dims, setup, Dtypes.of(setup), static_terms(dims, setup), batch_bytes(dims, setup))

    @property
    def t(self) -> int:
        return self.setup.total_seq_len

    @property
    def r(self) -> int:
        return self.setup.ranks

    @property
    def tokens_x_vocab(self) -> int:
        return self.t * self.dims.draft_vocab

    @property
    def layer(self) -> int:
        return max(self.dims.layer_params(i) for i in range(self.dims.layers))

    @property
    def parts(self) -> list[list[int]]:
        """The largest layer's FSDP parts (attention, MLP), each as its matrices' elements."""
        index = max(range(self.dims.layers), key=self.dims.layer_params)
        return self.dims.layer_parts(index)

    @property
    def state(self) -> int:
        """One [T x H] tensor of the residual stream."""
        return self.t * self.dims.hidden * self.d.stream

    def gather(self, params: list[int], before: int = 0) -> int:
        """An FSDP unit's gather at its largest (its parameters' elements `params`; `before`: the
        elements of the unit gathered before it in a forward, whose all-gather output FSDP frees when
        this one's copy-out is done): over R > 1 ranks the previous output, this one's and the unsharded
        weights; on one rank the unsharded weights and one parameter's bf16 copy."""
        if not self.setup.sharded:
            return 0
        n = sum(params)
        if self.r == 1:
            return (n + max(params)) * BF16
        return (before + 2 * n) * BF16

    @property
    def layer_gather(self) -> int:
        """A forward's gather of the layer's parts, one after the other (the attention after the layer's
        own unit, its norms; the MLP after the attention)."""
        norms = self.dims.layer_norms(True)
        befores = [norms, *map(sum, self.parts[:-1])]
        return max(self.gather(part, before) for part, before in zip(self.parts, befores))

    @property
    def retained(self) -> int:
        """The last part's all-gather output, kept after a forward's gather (R > 1 only)."""
        return sum(self.parts[-1]) * BF16 if self.setup.sharded and self.r > 1 else 0

    @property
    def gathered_layer(self) -> int:
        """Every part of the layer whole in bf16, as in a layer's backward under FSDP."""
        return self.layer * BF16 if self.setup.sharded else 0

    @property
    def layer_grads(self) -> int:
        """The layer's weight gradients summed over the TTT steps, whole in bf16 (FSDP)."""
        return self.layer * BF16 if self.setup.sharded else 0

    @property
    def layer_backward(self) -> int:
        """One process in bf16: autocast's bf16 gradient of the largest matrix and its fp32 copy."""
        return self.dims.largest_matrix * (BF16 + FP32) if self.setup.precision == "bf16" else 0

    @property
    def first_layer_backward(self) -> int:
        """Under FSDP, the backward of the last TTT step's layer (the first run): both parts whole,
        the MLP's gradients, then the attention's beside the MLP's (held by autograd, resharded)."""
        attention, mlp = map(sum, self.parts)
        return max(self.layer + mlp, 2 * attention + mlp) * BF16

    @property
    def root_grads(self) -> int:
        """FSDP's root unit's gradients, whole in bf16 until its reduce-scatter at the backward's end."""
        return self.dims.root_unit * BF16 if self.setup.sharded else 0

    def reduce_scatter(self) -> int:
        """The first TTT step's layer backward under FSDP, from the MLP's reduce-scatter on (module
        docstring): each part, last first, reduce-scattered (its bf16 gradients, their fp32 copy, this
        rank's fp32 share) beside the earlier parts, still whole with their gradients, and the last
        part's retained all-gather output; each part's backward beside the fp32 copy of the part
        reduce-scattered before it."""
        worst, copy = 0, 0
        sizes = [sum(part) for part in self.parts]
        for j in reversed(range(len(sizes))):
            earlier = 2 * sum(sizes[:j]) * BF16 + self.retained
            own = sizes[j]
            if copy:
                worst = max(worst, earlier + 2 * own * BF16 + copy)
            worst = max(worst, earlier + own * (BF16 + FP32) + -(-own * FP32 // self.r))
            copy = own * FP32
        return worst

    def backward_gradients(self, after_layer: bool) -> int:
        """The gradients alive in the backward: 04 drops the step before's after the forward (all of them
        stay while a --grad-accum group accumulates); in one process the new ones appear as the backward
        reaches each weight (the lm_head first, the layers `after_layer`, fc last); under FSDP the
        sharded ones only at the reduce-scatters (until then the layer's are `layer_grads`)."""
        if self.setup.grad_accum > 1:
            return self.static.gradients
        if self.setup.sharded:
            return 0
        layers = sum(self.dims.layer_params(i) for i in range(self.dims.layers)) if after_layer else 0
        return (self.dims.lm_head + layers) * FP32

    def at(self, phase: str, *, gradients: int | None = None, gathered: int | None = None, batch: int | None = None,
           targets: int = 0, activations: int = 0, transient: int = 0) -> MemoryBreakdown:
        s = self.static
        return MemoryBreakdown(phase, s.weights, s.gradients if gradients is None else gradients, s.optimizer_state,
                               s.frozen, s.gathered if gathered is None else gathered,
                               self.batch if batch is None else batch, targets, activations, transient)


def plain_phases(c: Step) -> list[MemoryBreakdown]:
    """The library's forward (every activation kept) and its backward."""
    dims, d, t, steps = c.dims, c.d, c.t, c.setup.ttt_steps
    v = c.tokens_x_vocab
    targets = v * (d.matmul + d.softmax)  # the verifier's logits (the forward's local) and p
    saved = plain_activations(dims, c.setup, d, steps)
    before_last = plain_activations(dims, c.setup, d, steps - 1)
    last_loss = t * dims.draft_vocab * d.softmax  # the last step's log-softmax, freed by the loss's backward
    state_grads = 2 * t * dims.hidden * FP32
    sharded = c.setup.sharded
    # the embedding (each step looks up, after the step before's MLP) or a layer part gathered
    gather = max(c.gather([dims.embedding], sum(c.parts[-1]) if steps > 1 else 0), c.layer_gather)
    phases = [
        # every earlier step saved
        c.at(GATHER_EMBEDDING, targets=targets, activations=before_last, transient=gather),
        # the last step's logits and the KL's product [T x V] beside the verifier's; its embeddings and
        # output state, the loop's locals
        c.at(FORWARD_END, targets=targets, activations=saved,
             transient=v * (d.matmul + (FP32 if d.softmax == FP32 else d.matmul)) + 2 * c.state + c.retained),
        # the loss's two [T x V] gradients (through the log-softmax)
        c.at(BACKWARD_START, gradients=c.backward_gradients(False), targets=v * d.softmax, activations=saved,
             transient=2 * v * d.softmax + c.root_grads + c.retained),
        # the layer's weights and gradients beside the states' gradients
        c.at(LAYER_BACKWARD, gradients=c.backward_gradients(False), targets=v * d.softmax,
             activations=saved - last_loss,
             transient=(c.first_layer_backward + c.retained if sharded else c.layer_backward) + c.root_grads
             + state_grads),
    ]
    if sharded:
        phases += [
            # the step before's layer: both parts whole beside the layer's gradients of the later steps
            c.at(EARLIER_LAYER_BACKWARD, gradients=c.backward_gradients(False), targets=v * d.softmax,
                 activations=before_last - last_loss,
                 transient=c.gathered_layer + c.layer_grads + c.retained + c.root_grads + state_grads),
            # the first step's layer (the last backward), its parts reduce-scattered from the MLP's on: the
            # step's own activations left, but for its loss's and its MLP's
            c.at(REDUCE_SCATTER, gradients=c.backward_gradients(False), targets=v * d.softmax,
                 activations=plain_activations(dims, c.setup, d, 1) - last_loss - t * 4 * dims.intermediate * d.matmul,
                 transient=c.reduce_scatter() + c.root_grads + state_grads)]
    return phases


def checkpointed_phases(c: Step) -> list[MemoryBreakdown]:
    """common/draft/forward.py's forward (each step checkpointed, the loss by tiles) and its backward,
    fed the dataset's tokens (04's default): the embedding is looked up once, at the forward's start."""
    dims, d, t, steps = c.dims, c.d, c.t, c.setup.ttt_steps
    kept = checkpoint_kept(dims, c.setup, d) * t
    mask = mask_saved(d, t, steps - 1)  # patch's CPU mask, whole after the last step
    held = steps * kept + mask
    tile = tile_transient(dims, d, min(TILE_TOKENS, t))
    # one step's activations as the plain forward saves them, but for the loss (in the tiles)
    per_token = (step_saved(dims, c.setup, d) - dims.draft_vocab * d.softmax
                 - dims.hidden * (d.matmul if d.linear_input_copies > 1 else d.normed))

    def recomputed(step: int) -> int:
        return per_token * t + kv_saved(dims, d, t, step)

    # gradients the backward holds for what the steps kept: the output and normed states' ([T x H]
    # each) and the keys' and values' of every step (slices of the last step's [S T x kv] gradient)
    output_grads = t * 2 * dims.hidden * d.stream
    kept_grads = output_grads + t * steps * dims.layers * 2 * dims.kv_width * d.matmul
    embeddings = c.state  # the dataset's tokens' embeddings, the forward's local
    mlp_saved = t * 4 * dims.intermediate * d.matmul  # the MLP's gate, silu(gate), up and their product
    phases = [
        # after the root's gather (fc and the lm_heads' first)
        c.at(GATHER_EMBEDDING, transient=c.gather([dims.embedding], dims.root_unit) + c.state),
        c.at(GATHER_LAYER, activations=(steps - 1) * kept + mask_saved(d, t, max(steps - 2, 0)),
             transient=embeddings + c.layer_gather),
        # the last step's output state and one loss tile's tensors
        c.at(FORWARD_END, activations=held, transient=embeddings + c.state + tile + c.retained),
        # the backward's first tiles: every step kept, the normed state's gradient growing
        c.at(TILE_RECOMPUTED, gradients=c.backward_gradients(False), activations=held,
             transient=tile + c.state + c.root_grads + c.retained),
    ]
    if not c.setup.sharded:
        return [*phases,
                # an earlier step's tiles: the last step's kept tensors freed, the gradients of the earlier ones held
                c.at(EARLIER_TILE_RECOMPUTED, gradients=c.backward_gradients(True), activations=held - kept,
                     transient=kept_grads + tile + c.root_grads),
                # a step recomputed: its own saved activations beside the gradients held
                c.at(STEP_RECOMPUTED, gradients=c.backward_gradients(True), activations=held,
                     transient=recomputed(steps - 1) + kept_grads + c.layer_backward + c.root_grads)]
    grads = c.backward_gradients(False)
    return [
        *phases,
        # the last step recomputed: its layer whole (and the MLP's gradients as its backward starts)
        c.at(LAST_STEP_RECOMPUTED, gradients=grads, activations=held,
             transient=recomputed(steps - 1) + output_grads + c.gathered_layer + sum(c.parts[-1]) * BF16 + c.retained
             + c.root_grads),
        # an earlier step's tiles: the last step's kept tensors freed, the layer's gradients held whole
        c.at(EARLIER_TILE_RECOMPUTED, gradients=grads, activations=held - kept,
             transient=kept_grads + tile + c.layer_grads + c.retained + c.root_grads),
        # the step before the last recomputed: its layer whole beside the later steps' layer gradients
        c.at(STEP_RECOMPUTED, gradients=grads, activations=held - kept,
             transient=recomputed(max(steps - 2, 0)) + kept_grads + c.gathered_layer + c.layer_grads + c.retained + c.root_grads),
        # the first step (the last backward): its layer's parts reduce-scattered, from the MLP's on (its
        # own saved activations freed)
        c.at(REDUCE_SCATTER, gradients=grads, activations=kept + mask,
             transient=recomputed(0) - mlp_saved + kept_grads + c.reduce_scatter() + c.root_grads),
    ]


def peak_memory(dims: DraftDims, setup: TrainSetup) -> MemoryBreakdown:
    """The largest of the step's phases (`phase_breakdowns`)."""
    return max(phase_breakdowns(dims, setup), key=lambda b: b.total)


def phase_breakdowns(dims: DraftDims, setup: TrainSetup) -> list[MemoryBreakdown]:
    """The rank's memory at each moment where it can peak: FSDP's gathers and the loss at the last TTT
    step, the backward's start and the layer's backwards (the last step's, an earlier one's, the first
    step's with the reduce-scatters, under FSDP), the recomputed tiles and steps (checkpointing), and
    the optimizer step (the gradients whole, no activations)."""
    c = Step.of(dims, setup)
    phases = checkpointed_phases(c) if setup.checkpointing else plain_phases(c)
    p = 0 if setup.checkpointing else c.tokens_x_vocab * c.d.softmax  # DraftLoss keeps the batch's p
    # the batch's states and ids stay the step's locals (ProjectTrainer.train_step); on CPUs patch keeps
    # its dense mask for the next batch
    batch = collated_bytes(dims, setup)
    mask = mask_saved(c.d, setup.total_seq_len, setup.ttt_steps - 1)
    return [*phases, c.at(OPTIMIZER_STEP, gathered=0, batch=batch, targets=p,
                          transient=mask + optimizer_transient(dims, setup))]


def optimizer_transient(dims: DraftDims, setup: TrainSetup) -> int:
    """The optimizer step's temporaries at their largest, one member after the other: the gradients'
    clipping (under FSDP a temporary of this rank's gradients, DTensor's norm; in place otherwise), Muon (in one process torch's, one matrix at a time:
    its Nesterov update in fp32 and the Newton-Schulz iterates in bf16; under FSDP `ShardedMuon`:
    `sharded_muon_transient`), AdamW (on GPUs its foreach step makes a temporary of its group's shard;
    on CPUs one parameter at a time, the largest the lm_head: sqrt of its second moment and that over
    the bias correction)."""
    r = setup.ranks if setup.sharded else 1
    if setup.optimizer != "muon":
        muon = 0
    elif setup.sharded:
        muon = sharded_muon_transient(dims, r)
    else:
        muon = dims.largest_matrix * (FP32 + 3 * BF16)
    adamw_group = dims.lm_head + dims.hidden * (dims.layers * 3 + 1)
    adamw = adamw_group * FP32 // r if setup.device == "cuda" else 2 * dims.lm_head * FP32 // r
    clip = dims.trainable * FP32 // r if setup.sharded else 0
    return max(clip, muon, adamw)


def sharded_muon_transient(dims: DraftDims, ranks: int) -> int:
    """`common.train.optimizers.ShardedMuon`'s step on the rank that owns the most: every matrix's
    Nesterov update of this rank's rows (fp32), their bf16 copies sent to the owners and the rows
    received back (bf16), and for each matrix it owns the whole update gathered and the padded result
    it scatters (bf16, both kept by their requests to the step's end); while it orthogonalises one, the
    Newton-Schulz iteration's two iterates of that matrix and its two Gram matrices (bf16)."""
    shapes = dims.matrix_shapes()
    chunks = [-(-rows // ranks) * cols for rows, cols in shapes]  # each rank's rows, padded to one chunk
    shared = sum(chunks) * (FP32 + 2 * BF16)
    owners = assign_owners([torch.Size(s) for s in shapes], ranks)
    worst = 0
    for rank in range(ranks):
        owned = [i for i, owner in enumerate(owners) if owner == rank]
        if not owned:
            continue
        wholes = sum(chunks[i] * ranks for i in owned) * 2 * BF16
        largest = max(owned, key=lambda i: (shapes[i][0] * shapes[i][1], ns_cost(torch.Size(shapes[i]))))
        rows, cols = shapes[largest]
        iteration = (2 * rows * cols + 2 * min(rows, cols) ** 2) * BF16
        worst = max(worst, wholes + iteration)
    return shared + worst


# --- measuring ---

class PeakTracker(TorchDispatchMode):
    """The bytes of every live tensor storage, and their peak, over a block of torch code: each storage
    an operator returns is counted once, from its creation until it is freed (a weak reference's
    callback), and resizes (FSDP frees and refills its gathered weights that way) are followed. Tensors
    made before the block count only when given to `track` (the model, the optimizer state). Exact for
    what torch allocates through its operators; the allocator's caching and the CUDA context are not
    tensors and are not counted.

        tracker = PeakTracker()
        tracker.track(model.parameters())
        with tracker:
            train_step()
        tracker.peak  # bytes

    torch's own `MemTracker` (torch.distributed._tools.mem_tracker) does this and more, but hooks a
    gradient onto every parameter of every module it sees, which raises on the draft's frozen weights."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0
        self._resize = None

    def track(self, *objects: Any) -> None:
        """Count these tensors (in any nesting of lists, tuples, dicts, iterables) from now on."""
        for obj in objects:
            items = list(obj) if isinstance(obj, Iterable) and not isinstance(obj, (torch.Tensor, dict)) else [obj]
            for t in tree_flatten(items)[0]:
                if isinstance(t, torch.Tensor):
                    self._add(t)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.device.type == "meta":
            return
        self._add_storage(t.untyped_storage())

    def _add_storage(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._grow(self._sizes[key])

    def _grow(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key)
        self._refs.pop(key, None)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._sizes:
            self._add_storage(storage)
            return
        old, self._sizes[key] = self._sizes[key], storage.nbytes()
        self._grow(self._sizes[key] - old)

    def __enter__(self) -> PeakTracker:
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int):
            result = original(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_  # not an operator: FSDP's frees and refills go through it
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor first turns the call into ops on its local tensors, seen here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
