"""common/train/distributed.py: a plain process is not distributed; under torchrun's environment
on a machine without GPUs the process group starts on gloo (04's two-rank run is in
tests/test_04_train.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common.train.distributed import setup_distributed, teardown_distributed, under_torchrun


def test_outside_torchrun_nothing_starts(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not under_torchrun()
    assert setup_distributed() == (0, 1, 0, False)
    assert not dist.is_initialized()
    teardown_distributed()  # nothing to end: no error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_torchrun_on_cpu_the_group_starts_on_gloo(monkeypatch):
    """What torchrun sets for rank 0 of a one-rank job."""
    assert not torch.accelerator.is_available()  # the CPU path this test is about
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    assert under_torchrun()
    try:
        assert setup_distributed() == (0, 1, 0, True)
        assert dist.get_backend() == "gloo"
    finally:
        teardown_distributed()
    assert not dist.is_initialized()


def test_a_rank_leaves_with_its_code_its_output_flushed_and_no_finalization():
    """leave_rank: the exit code kept, buffered output written, atexit (finalization) not run."""
    code = ("import atexit, sys; from common.train.distributed import leave_rank; "
            "atexit.register(lambda: print('finalized')); print('done', end=''); "
            "print('to stderr', file=sys.stderr, end=''); leave_rank(3)")
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (left.returncode, left.stdout) == (3, "done") and left.stderr.endswith("to stderr")


SHARD_SCRIPT = '''
import sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor
from common.draft import patch
from common.draft.model import TINY_CONFIG, build_draft, read_config_file, speculator_config
from common.target.config import load_target_info
from common.train.distributed import FROZEN_UNITS, LAYER_PARTS, setup_distributed, shard_draft, teardown_distributed
from common.vocab import build_maps

gathers = []  # (pass, the names of the parameters one all-gather gathers)
all_gather = _fsdp_param_group.foreach_all_gather

def recorded(fsdp_params, *args, **kwargs):
    gathers.append((phase, sorted(p._param_fqn for p in fsdp_params)))
    return all_gather(fsdp_params, *args, **kwargs)

_fsdp_param_group.foreach_all_gather = recorded
phase = "forward"

_, world, rank, _ = setup_distributed()
patch.apply(trust_remote_code=True, compile_forward=False, activation_checkpointing=sys.argv[2] == 'on')
info = load_target_info(sys.argv[1], trust_remote_code=True)
counts = torch.zeros(info.vocab_size, dtype=torch.long)
counts[:1000] = torch.arange(1000, 0, -1)
d2t, t2d = build_maps(counts, 256)
config = speculator_config(read_config_file(TINY_CONFIG).model, info, 256, info.default_layer_ids(), 3)
torch.manual_seed(0)
model = build_draft(config, t2d, d2t)
whole = {name: getattr(model, name).weight.detach().clone() for name in FROZEN_UNITS}
shard_draft(model, torch.device('cpu'))
for layer in model.layers:  # the attention and the MLP units of their own; the layer's unit keeps its norms
    assert all(isinstance(getattr(layer, part), FSDPModule) for part in LAYER_PARTS) and isinstance(layer, FSDPModule)
    own = {n for n, _ in layer.named_parameters() if not n.startswith(LAYER_PARTS)}
    assert own and all("norm" in n for n in own), own
g = torch.Generator().manual_seed(1)
n, h = 32, info.hidden_size
batch = {"hidden_states": torch.randn(1, n, 3 * h, generator=g), "input_ids": torch.randint(0, 1000, (1, n), generator=g),
         "verifier_last_hidden_states": torch.randn(1, n, h, generator=g), "loss_mask": torch.ones(1, n, dtype=torch.long),
         "lengths": torch.tensor([n]), "position_ids": torch.arange(n).unsqueeze(0)}
seen = []  # during the step, after the embedding's first call: is each frozen weight sharded?
model.norm.register_forward_pre_hook(lambda *_: seen.append([isinstance(getattr(model, n).weight, DTensor)
                                                             for n in FROZEN_UNITS]))
_, loss, _ = model(**batch, ttt_steps=2)
phase = "backward"
loss.backward()
units = {tuple(names) for _, names in gathers}
for part in LAYER_PARTS:  # each part gathered on its own, none with the other or the layer's norms
    assert any(names and all(n.startswith(f"layers.0.{part}.") for n in names) for names in units), (part, units)
assert not any("embed_tokens.weight" in names for p, names in gathers if p == "backward"), gathers  # never prefetched
for name in FROZEN_UNITS:
    weight = getattr(model, name).weight
    assert isinstance(weight, DTensor), (name, type(weight))  # resharded after its call
    local = weight.to_local()
    assert local.shape[0] == -(-whole[name].shape[0] // world), (name, local.shape)
    assert torch.equal(weight.full_tensor(), whole[name]), name
    assert weight.grad is None, name
# the embedding sharded at every step; the verifier lm_head gathered from step 1 on (read at step 0 at the latest)
assert len(seen) > 1 and all(embed for embed, _ in seen) and not any(head for _, head in seen[1:]), seen
assert model.fc.weight.grad is not None
open(f"{sys.argv[3]}/loss_{rank}", "w").write(repr(float(loss)))  # a file each: ranks' prints interleave
teardown_distributed()
'''


def test_frozen_weights_are_sharded_and_held_whole_only_while_they_run(flat_target, tmp_path):
    """Two gloo ranks: the embedding and verifier lm_head are FSDP units of their own, not the root's,
    which FSDP keeps gathered through the step. During the forward the embedding is sharded again after
    its lookups, the verifier lm_head stays gathered once read (its loss tiles read it again); the
    backward never gathers the embedding (FSDP's backward prefetch would, for nothing); after the
    backward both are sharded (each rank half their rows, together the target's weights, no gradient).
    Each decoder layer's attention and MLP are units of their own, gathered one at a time, the layer's
    unit holding its norms. The same with the checkpointed forward, whose loss is the library forward's."""
    script = tmp_path / "shard.py"
    script.write_text(SHARD_SCRIPT)
    losses = {}
    for checkpointing in ("off", "on"):
        out = tmp_path / checkpointing
        out.mkdir()
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script), str(flat_target), checkpointing, str(out)], capture_output=True, text=True,
                             timeout=300, cwd=Path(__file__).resolve().parents[3])
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        losses[checkpointing] = {(out / f"loss_{rank}").read_text() for rank in range(2)}
    assert len(losses["off"]) == 1 and losses["on"] == losses["off"], losses  # every rank, either forward
