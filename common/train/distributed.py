"""Starting and ending a `torchrun` job of step 04 on GPUs (NCCL) or on CPUs (gloo).

speculators 0.3.0's `maybe_setup_distributed` calls `torch.accelerator.set_device_index`, which
raises "Cannot access accelerator device when none is available" on a machine without GPUs, so
its distributed path cannot even start on CPU. With an accelerator we call the library's function
unchanged; without one we start the same process group on gloo, the backend torch uses for CPU
tensors. Everything after that (the distributed checkpointer, the packing sampler over ranks) is the
library's own path on either backend; the FSDP layout is `shard_draft`'s.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.utils import maybe_setup_distributed
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# The library's policy (speculators.train.utils.apply_fully_sharded): bf16 compute, fp32 reductions.
MIXED_PRECISION = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# The target's weights the draft reads, never trained, as FSDP units of their own, and whether each is
# resharded after every call (see shard_draft).
FROZEN_UNITS = {"embed_tokens": True, "verifier_lm_head": False}
# Each decoder layer's parts that are FSDP units of their own, inside the layer's unit (see shard_draft).
LAYER_PARTS = ("self_attn", "mlp")


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ  # the library's own test


def setup_distributed() -> tuple[int, int, int, bool]:
    """(local rank, world size, rank, distributed), as the library's `maybe_setup_distributed`."""
    if not under_torchrun() or torch.accelerator.is_available():
        return maybe_setup_distributed()
    dist.init_process_group("gloo")
    return int(os.environ["LOCAL_RANK"]), dist.get_world_size(), dist.get_rank(), True


def shard_draft(model: Eagle3DraftModel, device: torch.device) -> None:
    """The draft's FSDP2 layout: each decoder layer's attention and MLP units of their own inside the
    layer's unit, the frozen target weights units of their own, the rest in the root's; the library's
    mixed precision (`MIXED_PRECISION`), the draft's own initial weights.

    How it differs from the library's `apply_fully_sharded` (each decoder layer one unit, the rest in
    the root's), and why:

    - Attention and MLP are units of their own (sharded before their layer, whose unit keeps only the
      layer's norms), gathered and reduce-scattered one at a time. Kimi-K2.5's draft layer is 0.81B
      parameters (attention 0.41B, MLP 0.40B). FSDP2 gathers a unit whole in bf16 (its all-gather
      output, kept after a forward's gather until the next unit's, beside the unsharded weights) and
      reduce-scatters its gradients whole (in bf16, their fp32 copy kept until the next unit's
      reduce-scatter starts, this rank's share). As one unit the layer's first-TTT-step reduce-scatter,
      the largest moment of a checkpointed step, held 6.9 GB of these per rank of 8; split, the MLP's
      holds 5.0 GB (the attention whole with its gradients beside the MLP's buffers), and a forward's
      gathers hold at most 2.4 GB where they held 3.2 (common/train/memory_plan.py, `Step`). Splitting
      does not change what a layer's backward needs: both parts whole (a checkpointed step's recompute
      does not reshard, and FSDP prefetches the attention while the MLP's backward runs), and the
      layer's bf16 gradients, which autograd sums over the TTT steps before FSDP sees them.
    - The frozen embedding and verifier lm_head are units of their own. In the root's unit they would
      stay gathered through forward and backward on every rank (FSDP keeps the root unsharded after
      forward): Kimi-K2.5's 163,840 x 7,168 embedding alone is 2.3 GB in bf16 on each of 8 ranks. As
      their own units each rank keeps 1/world of their weights at rest. The embedding is resharded
      after each lookup (the checkpointed forward looks up once per step, or once per forward when fed
      the dataset's tokens: common/draft/forward.py), and never gathered by the backward: FSDP's
      backward prefetch would gather it whole (2.3 GB) when the first TTT step's layer backward starts
      (the unit before the layer in forward order) and keep it to the backward's end, for nothing (no
      gradient reads an embedding's weight; a recomputed lookup still gathers it, as a forward does).
      The verifier lm_head (the draft vocabulary's rows
      only, 32,000 x 7,168: 0.46 GB in bf16) stays gathered from its first call to the end of the
      backward, where FSDP reshards every unit: the checkpointed forward reads it once per loss tile
      and again when the backward recomputes the tile, which would otherwise be one all-gather per tile
      and pass.
    - The starting weights. The library's `setup_model` shards the draft (moving its layers to the
      meta device), then re-creates the layers on the hard-coded "cuda" and calls `reset_parameters`
      where a module has one, so the layers start from other weights than the draft built (and the RMS
      norms, which have no such method, from uninitialised memory). Here the layers are sharded on the
      meta device as the library does, re-created on `device`, and the draft's own initial weights
      loaded back from rank 0: a torchrun run starts where a single-process one does."""
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, reshard in FROZEN_UNITS.items():
        fully_shard(getattr(model, name), mp_policy=MIXED_PRECISION, reshard_after_forward=reshard)
    model.embed_tokens.set_unshard_in_backward(False)  # its weight is never read by a backward
    for layer in model.layers:
        layer.to_empty(device="meta")
        for part in LAYER_PARTS:  # FSDP takes a unit's children's own units out of it: children first
            fully_shard(getattr(layer, part), mp_policy=MIXED_PRECISION)
        fully_shard(layer, mp_policy=MIXED_PRECISION)
    fully_shard(model, mp_policy=MIXED_PRECISION)
    for layer in model.layers:
        layer.to_empty(device=device)
    set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                  strict=False))


def teardown_distributed() -> None:
    """End the process group, whichever started it, once every rank is done with it (the barrier:
    no collective of a peer still in flight). The library's `maybe_destroy_distributed` tests a
    flag only its own setup sets, so it would leave the gloo group above running."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave_rank(code: int) -> NoReturn:
    """End a torchrun rank whose work is done, with `code`, skipping interpreter finalization.
    Finalization destroys torch's and gloo's C++ objects in no set order and can abort a rank that
    has finished ("terminate called without an active exception", SIGABRT: seen on rank 1 of a
    2-rank CPU run after its last epoch); torchrun then stops the other ranks, rank 0 in the middle
    of exporting the draft. Nothing is left to write here: 04's files are written atomically and
    closed before this, the `with` blocks (the state engine's included) already exited."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
