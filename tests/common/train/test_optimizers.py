"""common/train/optimizers.py: which parameters Muon and AdamW get, the combined optimizer's
exact resume, and the library's schedule on both groups."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import packed_batch

from common.defaults import REPO_ROOT
from common.train.optimizers import (
    MuonWithAdamW,
    assign_owners,
    build_optimizer,
    build_scheduler,
    muon_parameters,
    ns_cost,
)
from common.train.settings import TrainSettings
from common.train.trainer import prepare_draft


def train_steps(model, opt, scheduler, seeds: range) -> None:
    """The library's step: forward, backward, clip, optimizer, scheduler."""
    for seed in seeds:
        _tokens, loss, _metrics = model(**packed_batch(seed), ttt_steps=2, use_off_policy_tokens=True)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()


def group_names(opt: torch.optim.Optimizer) -> list[set[str]]:
    return [set(g["param_names"]) for g in opt.param_groups]


def test_muon_takes_the_draft_layers_matrices_and_adamw_the_rest(tiny_draft):
    opt = build_optimizer(tiny_draft, TrainSettings(optimizer="muon"))
    muon, adamw = group_names(opt)
    assert muon == {"fc.weight", *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert {"lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"} <= adamw
    assert all(tiny_draft.get_parameter(n).ndim == 1 for n in adamw - {"lm_head.weight"})
    assert not {"embed_tokens.weight", "verifier_lm_head.weight"} & (muon | adamw)  # the target's, frozen
    assert [type(o) for o in (opt.muon, opt.adamw)] == [torch.optim.Muon, torch.optim.AdamW]


def test_muon_weight_decay_is_its_own_setting(tiny_draft):
    """`--muon-weight-decay` sets the Muon matrices' decay (by default upstream's 0.1); AdamW's stays 0.01."""
    muon, adamw = build_optimizer(tiny_draft, TrainSettings(muon_weight_decay=0.03)).param_groups
    assert (muon["weight_decay"], adamw["weight_decay"]) == (0.03, 0.01)
    muon, adamw = build_optimizer(tiny_draft, TrainSettings()).param_groups
    assert (muon["weight_decay"], adamw["weight_decay"]) == (0.1, 0.01)


def test_frozen_lm_head_is_in_no_group(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    prepare_draft(model, TrainSettings(freeze_draft_lm_head=True, init="torch"))
    assert not any("lm_head.weight" in names for names in group_names(build_optimizer(model, TrainSettings())))
    assert "lm_head.weight" not in {n for n, _ in muon_parameters(model)}


def test_adamw_is_the_librarys_optimizer(tiny_draft):
    opt = build_optimizer(tiny_draft, TrainSettings(optimizer="adamw", lr=3e-3))
    assert type(opt) is torch.optim.AdamW and len(opt.param_groups) == 1
    assert opt.param_groups[0]["param_names"] == [n for n, _ in tiny_draft.named_parameters()]
    assert opt.param_groups[0]["lr"] == 3e-3


def test_schedule_warms_up_and_decays_both_groups(tiny_draft):
    settings = TrainSettings(lr=1e-3, muon_lr=2e-2, epochs=2, warmup_steps=5)
    opt = build_optimizer(copy.deepcopy(tiny_draft), settings)
    scheduler = build_scheduler(opt, settings, steps_per_epoch=10)
    lrs = []
    for _ in range(20):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        scheduler.step()
    assert lrs[0] == [0.0, 0.0]
    assert lrs[5] == pytest.approx([2e-2, 1e-3])  # peak after the warm-up, Muon's own rate
    assert lrs[19] == pytest.approx([2e-2 / 15, 1e-3 / 15])  # linear to 0 at step 20
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [g["lr"] for g in opt.param_groups]
    assert build_scheduler(opt, TrainSettings(scheduler="none"), 10) is None


def test_muon_with_adamw_resumes_exactly(tiny_draft):
    """State saved after 2 steps and loaded into a fresh draft and optimizer: steps 3-4 give
    bitwise the weights of the uninterrupted run (momentum, AdamW moments and step, schedule)."""
    settings = TrainSettings(lr=5e-3, epochs=1, warmup_steps=1)
    whole = copy.deepcopy(tiny_draft)
    opt = build_optimizer(whole, settings)
    scheduler = build_scheduler(opt, settings, 4)
    train_steps(whole, opt, scheduler, range(2))
    saved = copy.deepcopy((whole.state_dict(), opt.state_dict(), scheduler.state_dict()))
    states = saved[1]["state"]
    assert set(states[0]) == {"momentum_buffer"} and "exp_avg_sq" in states[max(states)]  # Muon's, then AdamW's
    train_steps(whole, opt, scheduler, range(2, 4))

    resumed = copy.deepcopy(tiny_draft)
    resumed.load_state_dict(saved[0])
    opt2 = build_optimizer(resumed, settings)
    scheduler2 = build_scheduler(opt2, settings, 4)
    opt2.load_state_dict(saved[1])
    scheduler2.load_state_dict(saved[2])
    assert isinstance(opt2, MuonWithAdamW) and opt2.muon.state is opt2.state is opt2.adamw.state
    train_steps(resumed, opt2, scheduler2, range(2, 4))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(whole.fc.weight, tiny_draft.fc.weight)  # it did train


# --- Muon on FSDP2-sharded matrices, two gloo ranks ---------------------------------------------

SHAPES = [(24, 16), (16, 40), (7, 5), (1, 6), (64, 8)]  # uneven row splits, and a matrix of fewer rows than ranks
STEPS = 3


def matrices() -> torch.nn.Module:
    """Random matrices for Muon and a vector for AdamW, drawn from seed 0 (the same in every process)."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.w = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES])
    module.norm = torch.nn.Parameter(torch.ones(8))
    return module


def muon_with_adamw(module: torch.nn.Module) -> MuonWithAdamW:
    return MuonWithAdamW([(f"w.{i}", p) for i, p in enumerate(module.w)], [("norm", module.norm)], lr=0.01,
                         muon_lr=0.02, muon_weight_decay=0.1)


def gradients(step: int, module: torch.nn.Module) -> list[torch.Tensor]:
    """The whole gradient of each parameter at `step` (the same in every process)."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in module.parameters()]


SHARDED_MUON_SCRIPT = '''
import sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from common.train import optimizers
from common.train.distributed import setup_distributed, teardown_distributed
from test_optimizers import STEPS, gradients, matrices, muon_with_adamw

_, world, rank, _ = setup_distributed()
module = matrices()
fully_shard(module)
calls = []
newton_schulz = optimizers._zeropower_via_newtonschulz
def counted(update, *args):
    calls.append(tuple(update.shape))
    return newton_schulz(update, *args)
optimizers._zeropower_via_newtonschulz = counted
opt = muon_with_adamw(module)
assert type(opt.muon) is optimizers.ShardedMuon
for step in range(STEPS):
    for p, grad in zip(module.parameters(), gradients(step, module)):
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
    opt.step()
    opt.zero_grad()
buffers = [opt.state[p]["momentum_buffer"] for p in module.w]
assert all(isinstance(b, DTensor) and b.placements == p.placements for b, p in zip(buffers, module.w))
weights = [p.full_tensor() for p in module.parameters()]
momenta = [b.full_tensor() for b in buffers]
everyone = [None] * world
dist.all_gather_object(everyone, calls)
if rank == 0:
    torch.save({"weights": weights, "momenta": momenta, "calls": everyone}, sys.argv[1])
teardown_distributed()
'''


def test_sharded_muon_equals_one_process_with_each_matrix_orthogonalised_on_one_rank(tmp_path):
    """Two gloo ranks, FSDP2-sharded matrices (`fully_shard`), three steps: the weights and momentum
    of torch's Muon in one process (bitwise on this machine; the bound allows elementwise kernels that
    round a shard's tail otherwise), and each step's Newton-Schulz of each matrix run on exactly one
    rank, the one `assign_owners` names."""
    script = tmp_path / "sharded_muon.py"
    script.write_text(SHARDED_MUON_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=300,
                         cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1",
                                             "PYTHONPATH": os.pathsep.join(map(str, (REPO_ROOT, Path(__file__).parent, REPO_ROOT / "tests")))})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    sharded = torch.load(tmp_path / "out.pt", weights_only=True)

    module = matrices()
    opt = muon_with_adamw(module)
    assert type(opt.muon) is torch.optim.Muon  # one process: torch's own
    for step in range(STEPS):
        for p, grad in zip(module.parameters(), gradients(step, module)):
            p.grad = grad
        opt.step()
        opt.zero_grad()
    for ours, theirs in zip(sharded["weights"], module.parameters()):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-6)
    for ours, p in zip(sharded["momenta"], module.w):
        torch.testing.assert_close(ours, opt.state[p]["momentum_buffer"], rtol=0, atol=1e-6)

    owners = assign_owners([torch.Size(s) for s in SHAPES], 2)
    for rank, calls in enumerate(sharded["calls"]):
        mine = [s for s, owner in zip(SHAPES, owners) if owner == rank]
        assert calls == mine * STEPS, rank
    assert set(owners) == {0, 1}  # both ranks orthogonalise


def test_owners_are_balanced_by_newton_schulz_cost():
    """The costliest matrix first, each to the least-loaded rank (the lowest on a tie): one 64 x 64
    costs as much as four 32 x 64, so those four go to rank 1, and the two small ones split."""
    shapes = [torch.Size(s) for s in [(16, 16), (16, 16), (64, 64), (32, 64), (32, 64), (64, 32), (32, 64)]]
    owners = assign_owners(shapes, 2)
    assert owners == [0, 1, 0, 1, 1, 1, 1]
    assert [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(2)] == [64**3 + 16**3] * 2
    assert assign_owners(shapes, 1) == [0] * len(shapes)
