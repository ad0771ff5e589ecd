"""Adapting speculators 0.3.0 to Kimi-K2.5, to CPU training, to resuming, to a faster step and to more losses:
every monkey-patch the project applies to the library lives here, each small and explained.

    from common.draft import patch
    patch.apply(trust_remote_code=True, compile_forward=torch.cuda.is_available())

`apply` is explicit (importing this module changes nothing) and idempotent; calling it again
with other arguments replaces the earlier choice. What it installs:

1. `Eagle3DraftModel._setup_embeddings_and_lm_heads` (called from the model's constructor)
   reads `AutoConfig.from_pretrained(verifier).hidden_size` and the fixed keys
   `model.embed_tokens.weight` / `lm_head.weight`. Kimi-K2.5 nests its text model: the config
   is remote code with the fields under `text_config`, and the weights sit under
   `language_model.`. The replacement reads the target through `common.target.config` (nested or
   flat), reads only the two tensors it needs from the shards that hold them, and keeps the
   library's checks (hidden size, t2d size, masked lm_head shape).
2. speculators' attention `simple_flex_attention` calls FlexAttention, which has no backward
   on CPU (torch 2.13). Under the same name we register a dispatcher: on CPU it evaluates the
   block mask's `mask_mod` into a dense mask and runs SDPA; elsewhere it calls FlexAttention
   compiled on its own (`torch.compile(flex_attention)`, made once), or the plain function where a
   compiled forward traces it. The dense mask is made once per forward, as SDPA adds it (0 / -inf),
   and grows by the new keys' columns at each TTT step; where the forward runs eagerly, the
   library's `create_block_mask` skips the block structure on CPU, which nothing there reads.
   FlexAttention called eagerly would fall back to an implementation that materialises every
   score (8,192 x 8,192 per head for a pack, times the TTT step): an eager forward on a GPU
   (`compile_forward=False`, or the checkpointed forward of item 7) gets the compiled kernel too.
3. The single-process checkpointer loads a resumed model and optimizer onto the hard-coded
   `"cuda:0"`. Ours loads onto the CPU; `load_state_dict` then copies every tensor onto the
   device of the parameter it belongs to, so this is right on any device.
4. `Eagle3DraftModel.forward` is wrapped in `torch.compile` unconditionally. On CPU the
   compilation costs far more than it saves for a small draft (about 40 s per shape on two
   cores), so `compile_forward=False` restores the plain function; on GPU it stays compiled.

5. The Trainer averages each step's metrics over ranks with `dist.reduce(op=ReduceOp.AVG)`,
   which only NCCL implements: on gloo (torchrun on CPUs) it raises. The Trainer's module gets a
   view of `torch.distributed` whose `reduce` does AVG as SUM divided by the world size where
   the backend lacks it; everything else is `torch.distributed` itself.

6. The draft's loss (`compute_metrics`, once per TTT step) is a `common.draft.loss.DraftLoss`'s, chosen
   with `apply(loss=..., target_temperature=...)` (see that module); compiled with the KL loss at
   temperature 1, the library's function stays.

7. `apply(activation_checkpointing=True)` replaces the forward with `common.draft.forward`'s: the
   library's TTT loop with each step recomputed in the backward pass and the loss taken by tiles
   of tokens (the same `DraftLoss`), run eagerly (`compile_forward` then chooses nothing for it).

The EAGLE-3.1 norms (speculators 0.9.0's `norm_before_fc` / `norm_output`) are hooks on one draft,
not a patch of the library: see `common.draft.eagle31`.

The Trainer's device (it calls `model.to(local_rank)`, an int meaning CUDA) is handled where
the Trainer is configured: see `trainer_device`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from speculators.config import VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.eagle3 import core as library_core
from speculators.models.eagle3.attention import ALL_ATTENTION_FUNCTIONS
from speculators.train import checkpointer as library_checkpointer
from speculators.train import trainer as library_trainer
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from common.draft.forward import make_forward
from common.draft.loss import DraftLoss
from common.target.config import TargetError, load_target_info, read_tensors, weight_map

ATTENTION_NAME = "simple_flex_attention"  # the name speculators' draft layers are configured with
EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"

# The library's originals, kept so that tests can compare against the unpatched library.
ORIGINAL_SETUP = Eagle3DraftModel._setup_embeddings_and_lm_heads
ORIGINAL_FORWARD = Eagle3DraftModel.forward
ORIGINAL_CHECKPOINTER = library_trainer.SingleGPUCheckpointer
ORIGINAL_COMPUTE_METRICS = library_core.compute_metrics
ORIGINAL_CREATE_BLOCK_MASK = library_core.create_block_mask
BLOCK_SIZE = 128  # FlexAttention's default block, the library's


def apply(*, trust_remote_code: bool = False, compile_forward: bool = True, loss: str = "kl",
          target_temperature: float = 1.0, activation_checkpointing: bool = False) -> None:
    """Install the fixes above. `trust_remote_code` is used to read the target's config
    (Kimi-K2.5's is remote code); `compile_forward=False` runs the draft's forward eagerly;
    `loss` is the divergence the draft trains on, toward the verifier's distribution at
    `target_temperature` (see `common.draft.loss.DraftLoss`, which refuses other values);
    `activation_checkpointing` installs the checkpointed forward (item 7). A new `DraftLoss` each
    time: no batch's targets made under an earlier choice are kept."""
    draft_loss = DraftLoss(loss, target_temperature)
    Eagle3DraftModel._setup_embeddings_and_lm_heads = _make_setup(trust_remote_code)
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, attention_forward)
    library_trainer.SingleGPUCheckpointer = DeviceAgnosticCheckpointer
    compiled = compile_forward and not activation_checkpointing  # the library's forward, compiled whole
    if activation_checkpointing:
        Eagle3DraftModel.forward = make_forward(draft_loss)
    else:
        Eagle3DraftModel.forward = ORIGINAL_FORWARD if compile_forward else eager(ORIGINAL_FORWARD)
    library_trainer.dist = AVERAGING_DIST
    library_loss = compiled and draft_loss.is_library_loss
    library_core.compute_metrics = ORIGINAL_COMPUTE_METRICS if library_loss else draft_loss.compute_metrics
    library_core.create_block_mask = ORIGINAL_CREATE_BLOCK_MASK if compiled else create_block_mask


def eager(function):
    """The plain function under a `torch.compile` wrapper (the function itself if unwrapped)."""
    return getattr(function, "_torchdynamo_orig_callable", function)


def trainer_device(device: torch.device) -> torch.device:
    """What to pass as `TrainerConfig.local_rank`. The Trainer uses it only as a device
    (`model.to(local_rank)`, `tensor.to(local_rank)`) and to decide whether to draw its own
    progress bars (`local_rank == 0`). An int always means a CUDA device, so we pass a
    `torch.device` instead: it works on CPU, and `device == 0` is False, which turns off the
    library's bars in favour of ours (see `common.train.metrics.MetricsLog`)."""
    return torch.device(device)


# --- 1. embeddings and lm_head of a nested or flat target ---

def find_weight_keys(path: str | Path, prefix: str) -> tuple[str, str]:
    """(embedding key, lm_head key) of the target; a tied lm_head falls back to the
    embedding, as the library does. The error lists every key searched."""
    names = weight_map(path)
    embed_candidates = list(dict.fromkeys([prefix + EMBED_KEY, EMBED_KEY]))
    head_candidates = list(dict.fromkeys([prefix + LM_HEAD_KEY, LM_HEAD_KEY]))
    embed = next((k for k in embed_candidates if k in names), None)
    if embed is None:
        raise TargetError(f"target {path}: no embedding weights; searched {embed_candidates}")
    head = next((k for k in head_candidates if k in names), embed)
    return embed, head


_shared: dict[tuple, object] | None = None  # see target_weights_read_once


@contextmanager
def target_weights_read_once() -> Iterator[None]:
    """Within this block, every draft built on one target shares a single read of its embedding
    and lm_head (05 builds up to three drafts: about 4.6 GB read each time on Kimi-K2.5). Outside
    it nothing is kept, so 04 does not hold a second copy while it trains."""
    global _shared
    outer, _shared = _shared, ({} if _shared is None else _shared)
    try:
        yield
    finally:
        _shared = outer


def _read_once(key: tuple, read):
    """`read()`, or its result from earlier in a `target_weights_read_once` block."""
    if _shared is None:
        return read()
    if key not in _shared:
        _shared[key] = read()
    return _shared[key]


def _make_setup(trust_remote_code: bool):
    def _setup_embeddings_and_lm_heads(self: Eagle3DraftModel, config: VerifierConfig, t2d: torch.Tensor) -> None:
        """The library's method, reading the target through `common.target.config`."""
        if config.name_or_path is None:
            raise ValueError("VerifierConfig `name_or_path` value is required.")
        info = _read_once(("info", str(config.name_or_path), trust_remote_code),
                          lambda: load_target_info(config.name_or_path, trust_remote_code=trust_remote_code))
        if info.hidden_size != self.hidden_size:
            raise TargetError(f"target {info.path}: hidden size {info.hidden_size} does not match "
                              f"the draft's hidden size {self.hidden_size}")
        if t2d.shape[0] != info.vocab_size:
            raise TargetError(f"target {info.path}: vocabulary of {info.vocab_size} ids, "
                              f"but t2d has {t2d.shape[0]} entries")
        embed_key, head_key = find_weight_keys(info.path, info.weight_prefix)
        weights = _read_once(("weights", info.path, embed_key, head_key),
                             lambda: read_tensors(info.path, [embed_key, head_key]))

        self.embed_tokens = torch.nn.Embedding(info.vocab_size, self.hidden_size, padding_idx=info.pad_token_id)
        dtype = self.embed_tokens.weight.dtype
        self.embed_tokens.load_state_dict({"weight": weights[embed_key].to(dtype)})
        self.embed_tokens.weight.requires_grad = False

        self.lm_head = torch.nn.Linear(self.hidden_size, self.draft_vocab_size, bias=False)
        self.verifier_lm_head = torch.nn.Linear(self.hidden_size, self.draft_vocab_size, bias=False)
        masked = weights[head_key].to(device=t2d.device, dtype=dtype)[t2d.to(torch.bool), :]
        if masked.shape != self.lm_head.weight.shape:
            raise TargetError(f"target {info.path}: masked lm_head has shape {tuple(masked.shape)}, "
                              f"the draft's lm_head {tuple(self.lm_head.weight.shape)}")
        self.lm_head.weight.data = masked.detach().clone()
        self.verifier_lm_head.weight.data = masked.detach().clone()
        self.verifier_lm_head.weight.requires_grad = False

    return _setup_embeddings_and_lm_heads


# --- 2. attention with a backward on CPU ---

def dense_mask(mask_mod, q_len: int, kv_start: int, kv_end: int, device: torch.device) -> torch.Tensor:
    """The token-level boolean mask [q_len, kv_end - kv_start] of `mask_mod` over the keys
    kv_start..kv_end-1. speculators' mask functions are elementwise torch ops, so broadcasting
    a column of query indices against a row of key indices evaluates all pairs at once."""
    q = torch.arange(q_len, device=device).unsqueeze(1)
    kv = torch.arange(kv_start, kv_end, device=device).unsqueeze(0)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(zero, zero, q, kv).expand(q_len, kv_end - kv_start)


class AdditiveMask:
    """One forward's attention mask as SDPA adds it (0 where attended, -inf elsewhere), in the
    query's dtype: what SDPA makes of a boolean mask at every call, made here once. The key length
    grows by `q_len` per TTT step under the same `mask_mod` (the library extends its BlockMask
    and keeps the function), so only the new keys' columns are evaluated and appended. The key
    length is the real one, not the block-rounded `block_mask.shape`."""

    def __init__(self, mask_mod, q_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.mask_mod = weakref.ref(mask_mod)
        self.q_len, self.dtype, self.device = q_len, dtype, device
        self.mask = torch.empty(q_len, 0, dtype=dtype, device=device)

    def matches(self, mask_mod, q_len: int, dtype: torch.dtype) -> bool:
        return self.mask_mod() is mask_mod and (self.q_len, self.dtype) == (q_len, dtype)

    def up_to(self, kv_len: int) -> torch.Tensor:
        start = self.mask.shape[1]
        if kv_len > start:
            attended = dense_mask(self.mask_mod(), self.q_len, start, kv_len, self.device)
            new = torch.zeros(attended.shape, dtype=self.dtype, device=self.device).masked_fill_(~attended, float("-inf"))
            self.mask = torch.cat([self.mask, new], dim=1)
        return self.mask[:, :kv_len]


_mask: AdditiveMask | None = None  # the current forward's


def additive_mask(mask_mod, q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    global _mask
    if _mask is None or not _mask.matches(mask_mod, q_len, dtype):
        _mask = None  # the last forward's mask is freed before the new one is made
        _mask = AdditiveMask(mask_mod, q_len, dtype, device)
    return _mask.up_to(kv_len)


_compiled_flex_attention = None  # made at the first attention on a GPU


def compiled_flex_attention():
    """`flex_attention` compiled on its own, made once (its compiled kernels are cached by shape)."""
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        # dynamic shapes by default: the key length grows by a pack's length at each TTT step, and after
        # the first new length one kernel serves them all (no recompilation per step, no cache limit hit)
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


def flex_attention_function():
    """The FlexAttention to call: the compiled one, or the plain one inside a forward being compiled
    (which compiles it with the rest, rather than nesting one compiled function in another's trace)."""
    return flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: BlockMask, scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """speculators' attention: compiled FlexAttention where it has a backward, dense SDPA on CPU.
    Shapes as in transformers: query [B, H, Q, D], output [B, Q, H, D]; as the library's
    `flex_attention_forward` but for the function called."""
    if query.device.type != "cpu":
        out = flex_attention_function()(query.contiguous(), key.contiguous(), value.contiguous(),
                                        block_mask=attention_mask, enable_gqa=query.shape[1] != key.shape[1],
                                        scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    mask = additive_mask(attention_mask.mask_mod, query.shape[-2], key.shape[-2], query.dtype, query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,  # noqa: N803 - the library's names
                      device: torch.device | str = "cuda", **kwargs) -> BlockMask:
    """The library's `create_block_mask`, except on CPU: there the attention above reads only the
    mask's `mask_mod`, so the block structure (one evaluation of `mask_mod` over every pair) is
    not computed and every block is listed instead, which the library's
    `extend_mask_for_draft_tokens` extends as it extends any BlockMask."""
    if torch.device(device).type != "cpu":
        return ORIGINAL_CREATE_BLOCK_MASK(mask_mod, B, H, Q_LEN, KV_LEN, device=device, **kwargs)
    q_blocks, kv_blocks = -(-Q_LEN // BLOCK_SIZE), -(-KV_LEN // BLOCK_SIZE)
    kv_num_blocks = torch.full((1, 1, q_blocks), kv_blocks, dtype=torch.int32, device=device)
    kv_indices = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(1, 1, q_blocks, kv_blocks).contiguous()
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod,
                                    seq_lengths=(Q_LEN, KV_LEN))


# --- 3. resuming on any device ---

class DeviceAgnosticCheckpointer(ORIGINAL_CHECKPOINTER):
    """The library's single-process checkpointer, loading onto the CPU instead of "cuda:0"."""

    def load_model_state_dict(self, model, float_dtype: torch.dtype | None = None) -> None:
        state = library_checkpointer.load_safetensors_state_dict(self.model_path(self.previous_epoch), "cpu")
        state = library_checkpointer.convert_float_dtype(state, float_dtype or model.dtype)
        model.load_state_dict(state, strict=False)  # strict=False: the verifier's weights are not saved

    def load_optimizer_state_dict(self, model, optimizer: torch.optim.Optimizer,
                                  float_dtype: torch.dtype | None = None) -> None:
        state = torch.load(self.optimizer_path(self.previous_epoch), weights_only=True, map_location="cpu")
        optimizer.load_state_dict(library_checkpointer.convert_float_dtype(state, float_dtype or model.dtype))


# --- 5. metric averaging on gloo ---

class _AveragingDistributed:
    """`torch.distributed` with a `reduce` that also averages on backends without ReduceOp.AVG."""

    def __getattr__(self, name: str):
        return getattr(dist, name)

    @staticmethod
    def reduce(tensor: torch.Tensor, dst: int, op=dist.ReduceOp.SUM, **kwargs):
        if op == dist.ReduceOp.AVG and dist.get_backend() != "nccl":
            work = dist.reduce(tensor, dst, op=dist.ReduceOp.SUM, **kwargs)
            tensor.div_(dist.get_world_size())  # only the destination's value is read
            return work
        return dist.reduce(tensor, dst, op=op, **kwargs)


AVERAGING_DIST = _AveragingDistributed()
