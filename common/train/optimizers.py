"""Step 04's optimizers and learning-rate schedule, built where the library's Trainer builds its own
(`ProjectTrainer.setup_optimizer`).

speculators 0.3.0 hard-codes AdamW over every parameter; upstream speculators (0.9.0) defaults to
Muon for the 2-D weight matrices and AdamW for embeddings, norms and heads. Both are here:

    adamw   the library's own optimizer, unchanged: `AdamW(model.named_parameters(), lr)`
    muon    `torch.optim.Muon` on the weight matrices of the draft's decoder layers and of `fc`,
            AdamW on the rest that trains (the norms, the draft lm_head unless frozen)

The Trainer, the library's checkpointers and the scheduler each take one optimizer object, so
the two are driven through one `MuonWithAdamW`, a `torch.optim.Optimizer` whose parameter groups
and state are those of its two members: its `state_dict` is one ordinary optimizer state dict,
saved, resumed and (under FSDP) gathered by the library's code unchanged.

Muon's step is scaled to the RMS of an AdamW step (`adjust_lr_fn="match_rms_adamw"`, Moonlight's
rule), so the AdamW learning rate carries over (`muon_lr` defaults to `lr`). Its Newton-Schulz
iteration runs in bf16 (torch's `_zeropower_via_newtonschulz` casts the update with `.bfloat16()`
before iterating): the tensor cores' rate on GPUs, with fp32 weights and momentum kept.

Under torchrun the draft's matrices are FSDP2 shards (DTensors, `Shard(0)`). torch's Muon runs on
them through DTensor's operators: every rank takes part in every matrix's iteration, with collectives
inside it (on 2 ranks, per matrix and step: 11 all-reduces for a tall matrix, 15 all-gathers for a
wide one, whose products every rank then computes whole), the result off one process's by bf16
rounding, and a matrix with fewer rows than ranks fails. `ShardedMuon` gives each matrix one owner
rank instead (`assign_owners`): the momentum stays elementwise on the local shards, the owner gathers
the whole update, orthogonalises it with torch's own function, and scatters the result back as
shards: two collectives per matrix and step, the ranks orthogonalising different matrices at the
same time, and the update the single process's. The momentum buffers stay DTensors shaped like the parameters: the state
dict, its checkpoints and the library's FSDP checkpointer see what torch's Muon would give them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.optim._muon import _adjust_lr, _single_tensor_muon, _zeropower_via_newtonschulz
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from common.train.settings import TrainSettings

WEIGHT_DECAY = 0.01  # AdamW's default in torch, the library's (Muon's is `--muon-weight-decay`, 0.1 by default)
MUON_MODULES = ("layers.", "fc.")  # the draft's own matrices; embed_tokens and the lm_heads come from the target


def muon_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable weight matrices of the decoder layers and fc, with their names."""
    return [(name, p) for name, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and name.startswith(MUON_MODULES)]


def ns_cost(shape: torch.Size) -> int:
    """What one Newton-Schulz iteration costs on a matrix of `shape`, up to a constant factor: its
    products run on the smaller side's Gram matrix (m x m x n multiply-adds for m <= n)."""
    small, large = sorted(shape[:2])
    return small * small * large


def assign_owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix: the costliest first, each to the rank with the least
    work so far (the lowest rank on a tie), so the ranks finish together. Every rank computes the same
    list from the same shapes, with no message exchanged."""
    load = [0] * ranks
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        owners[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owners[i]] += ns_cost(shapes[i])
    return owners


def row_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor split by rows over a 1-D mesh in torch.chunk's layout (`ceil(rows / ranks)` rows per
    rank, the last ones shorter or empty), as FSDP2 shards a parameter and its gradient."""
    if not (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tuple(tensor.placements) == (Shard(0),)):
        return False
    mesh = tensor.device_mesh
    rows, chunk = tensor.shape[0], -(-tensor.shape[0] // mesh.size())
    return tensor.to_local().shape[0] == max(0, min(chunk, rows - mesh.get_local_rank() * chunk))


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon on FSDP2-sharded matrices: the same update, each matrix's Newton-Schulz on
    one owner rank (module docstring). A step, for the matrices of a group:

        1. momentum and the Nesterov update on each rank's own rows (elementwise, torch's ops)
        2. each update gathered, in bf16 (the iteration's own dtype), to the matrix's owner
        3. the owner orthogonalises it (`_zeropower_via_newtonschulz`, the group's coefficients, steps
           and eps) and scatters the rows back, in the same matrix order on every rank (collectives
           match by order); owners of later matrices compute while earlier ones are in flight
        4. each rank applies the weight decay and the adjusted learning rate (`_adjust_lr` of the
           whole matrix's shape) to its rows, as `_single_tensor_muon` does

    Parameters that are not row-sharded take torch's own step (every rank then runs it alike)."""

    def __init__(self, params, **kwargs) -> None:  # noqa: ANN001 - torch.optim.Muon's arguments
        super().__init__(params, **kwargs)
        sharded = [p for group in self.param_groups for p in group["params"] if row_sharded(p)]
        meshes = {p.device_mesh for p in sharded}
        if len(meshes) > 1:
            raise ValueError(f"ShardedMuon: the matrices are sharded over {len(meshes)} device meshes, expected one")
        self.mesh = meshes.pop() if meshes else None
        ranks = self.mesh.size() if self.mesh is not None else 1
        self.owners = dict(zip(map(id, sharded), assign_owners([p.shape for p in sharded], ranks)))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            sharded = [id(p) in self.owners and row_sharded(g) for p, g in zip(params, grads)]
            rest = [i for i, s in enumerate(sharded) if not s]
            if rest:
                _single_tensor_muon([params[i] for i in rest], [grads[i] for i in rest], [bufs[i] for i in rest],
                                    **muon_arguments(group))
            chosen = [i for i, s in enumerate(sharded) if s]
            if chosen:
                self.sharded_step(group, [params[i] for i in chosen], [grads[i] for i in chosen],
                                  [bufs[i] for i in chosen])
        return loss

    def sharded_step(self, group: dict, params: list[DTensor], grads: list[DTensor], bufs: list[DTensor]) -> None:
        momentum, lr = group["momentum"], float(group["lr"])
        updates = []
        for grad, buf in zip(grads, bufs):
            grad, buf = grad.to_local(), buf.to_local()  # the DTensors' own storage: updated in place
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
        owners = [self.owners[id(p)] for p in params]
        gathers = [self.gather_rows(update, p.shape, owner) for update, p, owner in zip(updates, params, owners)]
        scatters = []
        for p, owner, (work, whole) in zip(params, owners, gathers):
            ortho = None
            if owner == self.mesh.get_local_rank():
                work.wait()
                ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
            scatters.append(self.scatter_rows(ortho, p.shape, owner, p.to_local().device))
        for p, (work, rows) in zip(params, scatters):
            work.wait()
            local = p.to_local()
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(rows[: local.shape[0]], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    def chunk_rows(self, shape: torch.Size) -> int:
        return -(-shape[0] // self.mesh.size())

    def gather_rows(self, local: torch.Tensor, shape: torch.Size, owner: int) -> tuple[dist.Work, torch.Tensor | None]:
        """Start gathering this rank's rows of a matrix of `shape` to `owner`, in bf16, each rank's rows
        padded to one chunk (collectives move equal sizes). Returns the request and, on the owner, the
        whole matrix it fills."""
        chunk, ranks = self.chunk_rows(shape), self.mesh.size()
        send = local.new_zeros((chunk, shape[1]), dtype=torch.bfloat16)
        send[: local.shape[0]].copy_(local)
        whole = None
        if owner == self.mesh.get_local_rank():
            whole = local.new_empty((chunk * ranks, shape[1]), dtype=torch.bfloat16)
        work = dist.gather(send, list(whole.chunk(ranks)) if whole is not None else None, group=self.mesh.get_group(),
                           group_dst=owner, async_op=True)
        return work, whole[: shape[0]] if whole is not None else None

    def scatter_rows(self, ortho: torch.Tensor | None, shape: torch.Size, owner: int,
                     device: torch.device) -> tuple[dist.Work, torch.Tensor]:
        """Start sending each rank its rows of the owner's orthogonalised matrix (`ortho`, None on the
        other ranks). Returns the request and the chunk it fills (this rank's rows, then padding)."""
        chunk, ranks = self.chunk_rows(shape), self.mesh.size()
        rows = torch.empty((chunk, shape[1]), dtype=torch.bfloat16, device=device)
        parts = None
        if ortho is not None:
            padded = ortho.new_zeros((chunk * ranks, shape[1]))
            padded[: shape[0]].copy_(ortho)
            parts = list(padded.chunk(ranks))
        work = dist.scatter(rows, parts, group=self.mesh.get_group(), group_src=owner, async_op=True)
        return work, rows


def muon_arguments(group: dict) -> dict:
    """The keyword arguments of torch's `_single_tensor_muon` for a parameter group."""
    return {"lr": group["lr"], "weight_decay": group["weight_decay"], "momentum": group["momentum"],
            "nesterov": group["nesterov"], "ns_coefficients": group["ns_coefficients"],
            "ns_steps": group["ns_steps"], "eps": group["eps"], "adjust_lr_fn": group["adjust_lr_fn"],
            "has_complex": False}


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon_params`, AdamW on `adamw_params`, as one optimizer: groups `[muon, adamw]`
    (each member's groups are list items of this one's, the same dicts) and one state. Muon is
    torch's in a single process, `ShardedMuon` on FSDP2-sharded matrices."""

    def __init__(self, muon_params: list[tuple[str, torch.nn.Parameter]],
                 adamw_params: list[tuple[str, torch.nn.Parameter]], lr: float, muon_lr: float,
                 muon_weight_decay: float) -> None:
        sharded = any(isinstance(p, DTensor) for _, p in muon_params)  # under torchrun, after FSDP2
        muon_class = ShardedMuon if sharded else torch.optim.Muon
        self.muon = muon_class(muon_params, lr=muon_lr, weight_decay=muon_weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=WEIGHT_DECAY)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], defaults={})
        self._link()

    def _link(self) -> None:
        """Point both members at this optimizer's groups and state (after `load_state_dict`
        replaced them)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()


def build_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(model.named_parameters(), lr=settings.lr)  # the library's, unchanged
    matrices = muon_parameters(model)
    chosen = {id(p) for _, p in matrices}
    rest = [(name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) not in chosen]
    return MuonWithAdamW(matrices, rest, settings.lr, settings.muon_lr or settings.lr, settings.muon_weight_decay)


def group_learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The current learning rate of each member: {"muon": .., "adamw": ..} (the first group's of each),
    or {"adamw": ..} for AdamW alone."""
    if isinstance(optimizer, MuonWithAdamW):
        return {"muon": optimizer.muon.param_groups[0]["lr"], "adamw": optimizer.adamw.param_groups[0]["lr"]}
    return {"adamw": optimizer.param_groups[0]["lr"]}


def build_scheduler(optimizer: torch.optim.Optimizer, settings: TrainSettings,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The library's schedule (its `setup_optimizer`): warm-up of `warmup_steps` (default 1% of
    all steps), then linear or half-cosine decay to 0 at the last step; None for 'none'."""
    if settings.scheduler == "none":
        return None
    total = settings.epochs * steps_per_epoch
    warmup = settings.warmup_steps or total // 100
    if settings.scheduler == "linear":
        return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total)
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total, num_cycles=0.5)
