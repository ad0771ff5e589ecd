"""The memory one rank of 04's training holds at its peak, term by term, and a tracker that measures it.

    from common.train.memory_plan import DraftDims, TrainSetup, peak_memory
    plan = peak_memory(DraftDims.kimi_k25(), TrainSetup(total_seq_len=4096, ranks=8, precision="bf16",
                                                        device="cuda", checkpointing=True, grad_accum=2))
    print(plan.total, *plan.lines())

A structural model, not a fit: every term is a tensor the training step holds, counted from the draft's
shape (`DraftDims`) and the run's settings (`TrainSetup`), at each moment where the step's memory can
peak (`phase_breakdowns`); the peak is the largest. bench/bench_04_memory.py measures the same step with `PeakTracker`
at scaled shapes and compares (docs/kimi_k25.md holds the table).

Where the bytes go (T tokens per pack, H hidden, V the draft vocabulary, S TTT steps, R ranks):

- Weights, gradients and optimizer state of what trains (fc, the decoder layers, their norms, the draft
  lm_head), fp32, 1/R of each on a rank under FSDP: 4 + 4 bytes per parameter, plus Muon's one momentum
  (4) on the layers' and fc's matrices and AdamW's two moments (8) on the rest. Gradients persist from
  one step into the next forward (04 drops them after the forward; the backward makes new ones), and
  under FSDP with --grad-accum above 1 each rank keeps the whole gradient, in fp32, between a group's
  batches (`ProjectTrainer.train_step`: one reduce-scatter per optimizer step).
- Frozen: the target's embedding (target vocabulary x H) and the verifier lm_head (V x H), built in
  fp32 by the library. Under FSDP each is a unit of its own (`common.train.distributed.shard_draft`):
  1/R at rest; the embedding whole in bf16 only while it runs (FSDP's all-gather holds two whole copies
  for a moment).
- Gathered: FSDP keeps the root unit (fc, the draft lm_head, the final norm) and the verifier lm_head
  whole in bf16 from their first call to the end of the backward; a layer unit is whole in bf16 while
  it runs. In one process under
  bf16 autocast, the casts of the trained weights (cached by autocast) live as long as the graph.
- The batch: T x 4H fp32 states (three auxiliary layers, the last layer) and three int64 rows.
- The verifier's targets: its logits [T x V] and softmax p (kept by `DraftLoss` until the next batch).
- Saved activations, per TTT step and token, counted from the EAGLE-3 first layer (a Llama decoder
  layer reading [embedding, state]) and the loss (`step_saved`): the step's input and the attention
  input (2H each), four RMS norms' inputs and normed values, the residual sums, q and the attention
  output, 4 x intermediate in the SwiGLU MLP, the log-softmax over V, and the keys and values, which
  the cache concatenates: step k saves all (k+1) T of them. On CPUs patch's dense attention mask adds
  T x (k+1) T per step. With --activation-checkpointing (common/draft/forward.py) a step keeps only its
  input state and embeddings, its output normed state and its new keys and values, and the backward
  recomputes one step (and one loss tile) at a time.
- Transient: what lives only around the peak's moment (the last step's logits and the loss product at
  the forward's end, the loss gradients, FSDP's gathered layer and its gradients, the reduce-scatter
  buffer, the loss tiles and the recomputed step under checkpointing).

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
    # Under FSDP with grad_accum > 1, each rank keeps the whole gradient in fp32 between a group's batches
    # and reduce-scatters once per group (ProjectTrainer.train_step); False: reduce-scattered every batch.
    accumulate_whole: bool = True

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
REDUCE_SCATTER = "first reduce-scatter"
TILE_RECOMPUTED = "the last TTT step's loss tile recomputed"
EARLIER_TILE_RECOMPUTED = "an earlier TTT step's loss tile recomputed"
STEP_RECOMPUTED = "checkpointed step recomputed"
OPTIMIZER_STEP = "optimizer step"


@dataclass(frozen=True)
class Static:
    weights: int
    gradients: int
    optimizer_state: int
    frozen: int
    gathered: int


def static_terms(dims: DraftDims, setup: TrainSetup) -> Static:
    """What the rank holds through the forward, whatever the pack (the gradients of the step before)."""
    r = setup.ranks if setup.sharded else 1
    trainable = dims.trainable
    moments = dims.muon_params * FP32 + (trainable - dims.muon_params) * 2 * FP32 if setup.optimizer == "muon" \
        else trainable * 2 * FP32
    # the step before's, or under FSDP with accumulation the whole gradient kept between a group's batches
    whole = setup.sharded and setup.grad_accum > 1 and setup.accumulate_whole
    gradients = trainable * FP32 if whole else trainable * FP32 // r
    if setup.sharded:  # the root unit and the verifier lm_head stay gathered to the end of the backward
        gathered = (dims.root_unit + dims.verifier_head) * BF16
    elif setup.precision == "bf16":
        gathered = trainable * BF16  # autocast's cached casts of the trained weights
    else:
        gathered = 0
    return Static(trainable * FP32 // r, gradients, moments // r, (dims.embedding + dims.verifier_head) * FP32 // r,
                  gathered)


def batch_bytes(dims: DraftDims, setup: TrainSetup) -> int:
    """The collated batch on the device: states in fp32, input ids, loss mask and positions in int64;
    FSDP's root casts the states to bf16 on the way in (fc keeps its cast input for its weight's
    gradient), as does autocast for fc's input in one bf16 process."""
    t = setup.total_seq_len
    states = t * 4 * dims.hidden * FP32 + 3 * t * INT64
    if setup.sharded:
        states += t * 4 * dims.hidden * BF16
    elif setup.precision == "bf16":
        states += t * 3 * dims.hidden * BF16
    return states


@dataclass(frozen=True)
class Step:
    """What the phases of one training step share: the draft, the setup, their dtypes and sizes."""

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
    def tokens_x_vocab(self) -> int:
        return self.t * self.dims.draft_vocab

    @property
    def layer(self) -> int:
        return max(self.dims.layer_params(i) for i in range(self.dims.layers))

    @property
    def state(self) -> int:
        """One [T x H] tensor of the residual stream."""
        return self.t * self.dims.hidden * self.d.stream

    def gather(self, params: int) -> int:
        """An FSDP unit's all-gather: its output and the unsharded copy, whole in bf16, for a moment."""
        return 2 * params * BF16 if self.setup.sharded else 0

    @property
    def layer_backward(self) -> int:
        """A layer's backward: under FSDP its weights gathered again and its bf16 gradients; in one bf16
        process autocast's bf16 gradient of the largest matrix and its fp32 copy."""
        if self.setup.sharded:
            return 2 * self.layer * BF16
        return self.dims.largest_matrix * (BF16 + FP32) if self.setup.precision == "bf16" else 0

    @property
    def root_grads(self) -> int:
        """FSDP's root unit's gradients, whole in bf16 until its reduce-scatter at the backward's end."""
        return self.dims.root_unit * BF16 if self.setup.sharded else 0

    def reduce_scatter(self) -> int:
        """A layer's reduce-scatter: its bf16 gradients, their fp32 copy sent, this rank's fp32 share."""
        return self.layer * (BF16 + FP32 + FP32 // self.setup.ranks)

    def backward_gradients(self, after_layer: bool) -> int:
        """The gradients alive in the backward: 04 drops the step before's after the forward (all of them
        stay while a --grad-accum group accumulates); the new ones appear as the backward reaches each
        weight (the lm_head first, the layers `after_layer`, fc last); FSDP's sharded ones at each
        unit's reduce-scatter."""
        if self.setup.grad_accum > 1:
            return self.static.gradients
        if self.setup.sharded:
            return self.layer * FP32 // self.setup.ranks if after_layer else 0
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
    phases = [
        # the embedding (each step looks up) or the layer gathered, every earlier step saved
        c.at(GATHER_EMBEDDING, targets=targets, activations=before_last,
             transient=c.gather(max(dims.embedding, c.layer))),
        # the last step's logits and the KL's product [T x V] beside the verifier's; its embeddings and
        # output state, the loop's locals
        c.at(FORWARD_END, targets=targets, activations=saved,
             transient=v * (d.matmul + (FP32 if d.softmax == FP32 else d.matmul)) + 2 * c.state),
        # the loss's two [T x V] gradients (through the log-softmax)
        c.at(BACKWARD_START, gradients=c.backward_gradients(False), targets=v * d.softmax, activations=saved,
             transient=2 * v * d.softmax + c.root_grads),
        # the layer's weights and gradients beside the states' gradients
        c.at(LAYER_BACKWARD, gradients=c.backward_gradients(False), targets=v * d.softmax,
             activations=saved - last_loss, transient=c.layer_backward + c.root_grads + 2 * t * dims.hidden * FP32),
    ]
    if c.setup.sharded:
        phases.append(c.at(REDUCE_SCATTER, gradients=c.backward_gradients(False), targets=v * d.softmax,
                           activations=before_last, transient=c.reduce_scatter() + c.root_grads))
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
    recomputed = (step_saved(dims, c.setup, d) - dims.draft_vocab * d.softmax
                  - dims.hidden * (d.matmul if d.linear_input_copies > 1 else d.normed)) * t \
        + kv_saved(dims, d, t, steps - 1)
    # gradients the backward holds for what the steps kept: the output and normed states' ([T x H]
    # each) and the keys' and values' of every step (slices of the last step's [S T x kv] gradient)
    kept_grads = t * (2 * dims.hidden * d.stream + steps * dims.layers * 2 * dims.kv_width * d.matmul)
    embeddings = c.state  # the dataset's tokens' embeddings, the forward's local
    phases = [
        c.at(GATHER_EMBEDDING, transient=c.gather(dims.embedding) + c.state),
        c.at(GATHER_LAYER, activations=(steps - 1) * kept + mask_saved(d, t, max(steps - 2, 0)),
             transient=embeddings + c.gather(c.layer)),
        # the last step's output state and one loss tile's tensors
        c.at(FORWARD_END, activations=held, transient=embeddings + c.state + tile),
        # the backward's first tiles: every step kept, the normed state's gradient growing
        c.at(TILE_RECOMPUTED, gradients=c.backward_gradients(False), activations=held,
             transient=tile + c.state + c.root_grads),
        # an earlier step's tiles: the last step's kept tensors freed, the gradients of the earlier ones held
        c.at(EARLIER_TILE_RECOMPUTED, gradients=c.backward_gradients(True), activations=held - kept,
             transient=kept_grads + tile + c.root_grads),
        # a step recomputed: its own saved activations beside the gradients held
        c.at(STEP_RECOMPUTED, gradients=c.backward_gradients(True), activations=held,
             transient=recomputed + kept_grads + c.layer_backward + c.root_grads),
    ]
    if c.setup.sharded:
        phases.append(c.at(REDUCE_SCATTER, gradients=c.backward_gradients(False), activations=held,
                           transient=kept_grads + c.reduce_scatter() + c.root_grads))
    return phases


def peak_memory(dims: DraftDims, setup: TrainSetup) -> MemoryBreakdown:
    """The largest of the step's phases (`phase_breakdowns`)."""
    return max(phase_breakdowns(dims, setup), key=lambda b: b.total)


def phase_breakdowns(dims: DraftDims, setup: TrainSetup) -> list[MemoryBreakdown]:
    """The rank's memory at each moment where it can peak: FSDP's gathers and the loss at the last TTT
    step, the backward's start and its layer, the first reduce-scatter (FSDP), the recomputed tiles
    and steps (checkpointing), and the optimizer step (the gradients whole, no activations)."""
    c = Step.of(dims, setup)
    phases = checkpointed_phases(c) if setup.checkpointing else plain_phases(c)
    p = 0 if setup.checkpointing else c.tokens_x_vocab * c.d.softmax  # DraftLoss keeps the batch's p
    return [*phases, c.at(OPTIMIZER_STEP, gathered=0, batch=0, targets=p, transient=optimizer_transient(dims, setup))]


def optimizer_transient(dims: DraftDims, setup: TrainSetup) -> int:
    """The optimizer step's temporaries: Muon orthogonalises one matrix at a time (its Nesterov update
    in fp32 and Newton-Schulz iterates in bf16; under FSDP the matrix gathered whole); AdamW's foreach
    step on GPUs makes a temporary of its group's shard."""
    largest = dims.largest_matrix
    muon = largest * (FP32 + 3 * BF16 + (FP32 if setup.sharded else 0))
    adamw_group = dims.lm_head + dims.hidden * (dims.layers * 3 + 1)
    adamw = (adamw_group * FP32 // (setup.ranks if setup.sharded else 1)) if setup.device == "cuda" else dims.lm_head * FP32
    return (muon if setup.optimizer == "muon" else 0) + adamw


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
