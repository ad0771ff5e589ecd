"""common/train/trainer.py: the draft's starting point (initialisation, frozen lm_head), what
the Trainer feeds the TTT steps in training and in validation, the precision it computes in, and
gradient accumulation (`--grad-accum`) against one step on the mean loss."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import packed_batch

from common.train.metrics import METRICS_LOGGER
from common.train.optimizers import build_optimizer, build_scheduler
from common.train.settings import TrainSettings
from common.train.trainer import ProjectTrainer, autocast, group_place, optimizer_steps, prepare_draft, trainer_config


def own_linears(model) -> list[torch.nn.Linear]:
    return [m for m in [*model.layers.modules(), model.fc] if isinstance(m, torch.nn.Linear)]


def test_normal_init_draws_the_draft_layers_from_n_0_002(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    torch.manual_seed(1)
    prepare_draft(model, TrainSettings(init="normal"))
    weights = torch.cat([m.weight.flatten() for m in own_linears(model)])
    assert weights.std().item() == pytest.approx(0.02, rel=0.02) and abs(weights.mean().item()) < 1e-3
    assert torch.equal(model.lm_head.weight, tiny_draft.lm_head.weight)  # the target's, untouched
    assert torch.equal(model.embed_tokens.weight, tiny_draft.embed_tokens.weight)
    assert all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in (model.norm, model.layers[0].input_layernorm))
    again = copy.deepcopy(tiny_draft)
    torch.manual_seed(1)
    prepare_draft(again, TrainSettings(init="normal"))
    assert torch.equal(again.fc.weight, model.fc.weight)  # drawn from the seeded generator


def test_torch_init_keeps_the_built_weights(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    prepare_draft(model, TrainSettings(init="torch"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny_draft.state_dict().values()))
    bound = 1 / (3 * 64) ** 0.5  # nn.Linear's kaiming-uniform bound for fc's 192 inputs
    assert model.fc.weight.abs().max().item() <= bound


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_frozen_draft_lm_head_stays_the_targets(tiny_draft, optimizer):
    model = copy.deepcopy(tiny_draft)
    settings = TrainSettings(freeze_draft_lm_head=True, optimizer=optimizer, lr=1e-2)
    prepare_draft(model, settings)
    opt = build_optimizer(model, settings)
    _tokens, loss, _metrics = model(**packed_batch(0), ttt_steps=2)
    loss.backward()
    opt.step()
    assert torch.equal(model.lm_head.weight, tiny_draft.verifier_lm_head.weight)
    assert not torch.equal(model.fc.weight, tiny_draft.fc.weight)


def test_ttt_inputs_reach_the_training_forward_only():
    config = trainer_config(TrainSettings(), Path("ckpt"), False, False, torch.device("cpu"))
    assert config.train_call_kwargs["use_off_policy_tokens"] is True  # the default: teacher-forced
    assert "use_off_policy_tokens" not in config.val_call_kwargs  # validation feeds the draft's guesses, as serving
    old = trainer_config(TrainSettings(ttt_inputs="draft"), Path("ckpt"), False, False, torch.device("cpu"))
    assert old.train_call_kwargs["use_off_policy_tokens"] is False


def test_teacher_forcing_changes_what_step_1_sees(tiny_draft):
    """Step 0 reads the same tokens either way; from step 1 on, the dataset's tokens differ
    from an untrained draft's guesses, so the loss does too."""
    settings = TrainSettings()
    metrics = {}
    for inputs in ("dataset", "draft"):
        kwargs = TrainSettings(ttt_inputs=inputs).train_call_kwargs()
        with torch.no_grad():
            _tokens, _loss, metrics[inputs] = tiny_draft(**packed_batch(3), **kwargs)
    assert metrics["dataset"]["loss_0"] == metrics["draft"]["loss_0"]
    assert metrics["dataset"]["loss_1"] != metrics["draft"]["loss_1"]
    assert settings.call_kwargs() == {"ttt_steps": 3, "ttt_step_loss_decay": 1.0}


@pytest.mark.parametrize(("precision", "device", "expected"), [
    ("auto", "cpu", None), ("auto", "cuda", torch.bfloat16), ("bf16", "cpu", torch.bfloat16),
    ("fp32", "cuda", None)])
def test_precision_picks_bf16_autocast_on_gpus(precision, device, expected):
    assert TrainSettings(precision=precision).autocast_dtype(torch.device(device)) == expected


def test_bf16_autocast_keeps_fp32_weights_and_gradients(tiny_draft):
    model = copy.deepcopy(tiny_draft)
    seen = []
    model.fc.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    autocast(model, "cpu", torch.bfloat16)
    _tokens, loss, _metrics = model(**packed_batch(0), ttt_steps=2)
    loss.backward()
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32  # matmuls in bf16, the loss in fp32
    assert model.fc.weight.dtype == model.fc.weight.grad.dtype == torch.float32
    plain = copy.deepcopy(tiny_draft)
    autocast(plain, "cpu", None)  # fp32: the forward untouched
    assert "forward" not in vars(plain)


# --- gradient accumulation ----------------------------------------------------------------------


class Batches(list):
    """Packed batches as the Trainer reads its loader: iterated, counted, and a sampler to skip by."""

    def __init__(self, batches: list[dict]) -> None:
        super().__init__(batches)
        self.batch_sampler = SimpleNamespace(skip=0)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"step": record.step, **record.msg})


def trainer_epoch(tiny_draft, settings: TrainSettings, batches: list[dict], folder: Path) -> tuple[torch.nn.Module,
                                                                                                     list[dict]]:
    """The draft after one ProjectTrainer epoch over `batches`, and the epoch's metric records."""
    model = copy.deepcopy(tiny_draft)
    trainer = ProjectTrainer(model, trainer_config(settings, folder, False, False, torch.device("cpu")), settings,
                             Batches(batches), None, None)
    logger, handler = logging.getLogger(METRICS_LOGGER), Records()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer.train_epoch(0)
    finally:
        logger.removeHandler(handler)
    assert trainer.global_step == trainer.steps_per_epoch == optimizer_steps(len(batches), settings.grad_accum)
    return model, handler.records


def mean_loss_steps(tiny_draft, settings: TrainSettings, groups: list[list[dict]]) -> tuple[torch.nn.Module,
                                                                                           list[dict]]:
    """The reference: per group, one graph over its batches, backward of the mean of their losses,
    clip, optimizer and schedule step (`len(groups)` steps an epoch); and each batch's metrics."""
    model = copy.deepcopy(tiny_draft)
    opt = build_optimizer(model, settings)
    scheduler = build_scheduler(opt, settings, len(groups))
    metrics = []
    for group in groups:
        outputs = [model(**batch, **settings.train_call_kwargs()) for batch in group]
        metrics += [{k: v.item() for k, v in out[2].items()} for out in outputs]
        opt.zero_grad()
        (sum(out[1] for out in outputs) / len(group)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
    return model, metrics


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_two_accumulated_batches_step_as_their_mean_loss(tiny_draft, tmp_path, optimizer):
    """--grad-accum 2 over 2 batches: one optimizer step, the weights of one step on the mean of the
    two losses computed in one graph (within float rounding: the gradients add up in another order)."""
    settings = TrainSettings(optimizer=optimizer, lr=5e-3, epochs=1, grad_accum=2)
    batches = [packed_batch(seed) for seed in range(2)]
    model, records = trainer_epoch(tiny_draft, settings, batches, tmp_path)
    reference, metrics = mean_loss_steps(tiny_draft, settings, [batches])
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=name)
    assert not torch.equal(model.fc.weight, tiny_draft.fc.weight)
    assert len(records) == 1 and records[0]["step"] == 0 and records[0]["tokens"] == 48  # the two batches' tokens
    for key, value in records[0]["train"].items():
        assert value == pytest.approx((metrics[0][key] + metrics[1][key]) / 2, rel=1e-5), key


def test_an_epochs_last_group_steps_with_its_own_count(tiny_draft, tmp_path):
    """--grad-accum 2 over 5 batches: 3 optimizer steps, the last on the one batch left (its loss
    scaled by 1, not 1/2), each the step of its batches' mean loss; the schedule spans the 3 steps;
    one record per step."""
    settings = TrainSettings(optimizer="adamw", lr=5e-3, epochs=1, grad_accum=2)
    batches = [packed_batch(seed) for seed in range(5)]
    model, records = trainer_epoch(tiny_draft, settings, batches, tmp_path)
    groups = [batches[0:2], batches[2:4], batches[4:]]
    reference, metrics = mean_loss_steps(tiny_draft, settings, groups)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=name)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["lr"] for r in records] == pytest.approx([5e-3, 5e-3 * 2 / 3, 5e-3 / 3])  # linear to 0 over 3 steps
    assert [r["tokens"] for r in records] == [48, 48, 24]
    assert records[2]["train"] == pytest.approx(metrics[4], rel=1e-5)  # a group of one: its batch's metrics


def test_one_batch_per_step_is_the_librarys_step(tiny_draft, tmp_path):
    """--grad-accum 1 (the default): bitwise the library's loop, one step and one record per batch."""
    settings = TrainSettings(lr=5e-3, epochs=1)
    batches = [packed_batch(seed) for seed in range(3)]
    model, records = trainer_epoch(tiny_draft, settings, batches, tmp_path)
    reference, metrics = mean_loss_steps(tiny_draft, settings, [[b] for b in batches])
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours, theirs), name
    assert [r["train"] for r in records] == metrics and [r["tokens"] for r in records] == [24] * 3


def test_groups_start_at_the_epochs_first_batch():
    assert [group_place(done, 7, 3) for done in range(7)] == [(0, 3), (1, 3), (2, 3), (0, 3), (1, 3), (2, 3), (0, 1)]
    assert [group_place(done, 4, 1) for done in range(4)] == [(0, 1)] * 4
    assert [optimizer_steps(n, 3) for n in (1, 3, 4, 7)] == [1, 1, 2, 3]


ACCUMULATE_SCRIPT = '''
import copy
import sys
from pathlib import Path
import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from helpers import packed_batch
from common.draft import patch
from common.draft.model import TINY_CONFIG, build_draft, read_config_file, speculator_config
from common.target.config import load_target_info
from common.train import distributed
from common.train.distributed import setup_distributed, teardown_distributed
from common.train.settings import TrainSettings
from common.train.trainer import ProjectTrainer, trainer_config
from common.vocab import build_maps
from test_trainer import Batches, mean_loss_steps

_, world, rank, _ = setup_distributed()
patch.apply(trust_remote_code=True, compile_forward=False)
info = load_target_info(sys.argv[1], trust_remote_code=True)
counts = torch.zeros(info.vocab_size, dtype=torch.long)
counts[:400] = torch.arange(400, 0, -1)
d2t, t2d = build_maps(counts, 200)
config = speculator_config(read_config_file(TINY_CONFIG).model, info, 200, info.default_layer_ids(), 3)
torch.manual_seed(0)
draft = build_draft(config, t2d, d2t)
settings = TrainSettings(lr=5e-3, epochs=1, grad_accum=2, optimizer="adamw")
batches = {r: [packed_batch(10 * r + i) for i in range(2)] for r in range(world)}  # each rank its own two
# fp32 compute under FSDP (04 gathers bf16 weights), so that the step compares with one fp32 process
distributed.MIXED_PRECISION = MixedPrecisionPolicy()
syncs = []
FSDPModule.set_requires_gradient_sync = lambda self, sync, **kwargs: syncs.append(sync)
held = []  # after each batch: is every gradient this rank's shard (a row-sharded DTensor of the shard's shape)?
train_step = ProjectTrainer.train_step

def checked_step(self, micro, epoch):
    train_step(self, micro, epoch)
    params = [p for p in self.model.parameters() if p.requires_grad]
    held.append(all(isinstance(p.grad, DTensor) and tuple(p.grad.placements) == (Shard(0),)
                    and p.grad.to_local().shape == p.to_local().shape for p in params))

ProjectTrainer.train_step = checked_step
trainer = ProjectTrainer(copy.deepcopy(draft), trainer_config(settings, Path(sys.argv[2]), False, True,
                                                              torch.device("cpu")),
                         settings, Batches(batches[rank]), None, None)
trainer.train_epoch(0)
assert trainer.global_step == 1
assert syncs == [], syncs  # every batch reduce-scattered: no exchange put off
assert held == [True, True], held  # no rank holds a whole gradient between a group's batches
# one process, one step on the mean loss of the 4 batches (each rank's 2, FSDP averaging the ranks)
reference, _ = mean_loss_steps(draft, settings, [[b for r in range(world) for b in batches[r]]])
ours = dict(trainer.model.named_parameters())
assert "fc.weight" in ours
for name, theirs in reference.named_parameters():
    p = ours[name]
    if theirs.grad is not None:  # the clipped gradient of the mean loss
        torch.testing.assert_close(p.grad.full_tensor(), theirs.grad, rtol=1e-4, atol=1e-7, msg=name)
    torch.testing.assert_close(p.full_tensor(), theirs, rtol=0, atol=1e-5, msg=name)
assert not torch.equal(ours["fc.weight"].full_tensor(), draft.fc.weight)
print(f"rank {rank} ok")
teardown_distributed()
'''


def test_under_fsdp_each_batch_is_reduce_scattered_to_the_step_of_the_mean_loss(flat_target, tmp_path):
    """Two gloo ranks, --grad-accum 2: each batch's gradients are reduce-scattered as its backward makes
    them, into the sharded gradient (no `set_requires_gradient_sync(False)`): after each batch every
    gradient is this rank's shard, none whole. The step is one process's on the mean loss of the four
    batches, gradients and weights (FSDP computing in fp32 here, so that the two compare)."""
    script = tmp_path / "accumulate.py"
    script.write_text(ACCUMULATE_SCRIPT)
    tests = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(flat_target), str(tmp_path / "checkpoints")], capture_output=True, text=True,
                         timeout=300, cwd=tests.parent,
                         env={**os.environ, "OMP_NUM_THREADS": "1",
                              "PYTHONPATH": os.pathsep.join(map(str, (tests.parent, Path(__file__).parent, tests)))})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count(" ok") == 2
