"""common/train/memory_plan.py: the trainer-memory model's terms against the draft the library builds and
against a measured training step, and the live-tensor tracker that measures it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.bench_04_memory import BenchShape, run_case
from common.train.memory_plan import (
    FORWARD_END,
    DraftDims,
    PeakTracker,
    Step,
    TrainSetup,
    peak_memory,
    phase_breakdowns,
    sharded_muon_transient,
)
from common.train.optimizers import muon_parameters

TINY = BenchShape("tiny", hidden=64, heads=2, intermediate=160, draft_vocab=1000, target_vocab=4000,
                  total_seq_len=512, head_dim=32)
KIMI = DraftDims.kimi_k25()


def gpu(total_seq_len: int, **changes) -> TrainSetup:
    """An 8-rank FSDP rank on GPUs (bf16), with `changes`."""
    return TrainSetup(**{"total_seq_len": total_seq_len, "ranks": 8, "precision": "bf16", "device": "cuda", **changes})


def test_parameter_counts_are_the_built_drafts(tiny_draft):
    d = tiny_draft
    layer = d.layers[0]
    dims = DraftDims(64, 1, layer.self_attn.config.num_attention_heads, layer.self_attn.config.num_key_value_heads,
                     layer.self_attn.head_dim, layer.mlp.gate_proj.out_features, d.lm_head.out_features,
                     d.embed_tokens.num_embeddings)
    trainable = sum(p.numel() for p in d.parameters() if p.requires_grad)
    assert dims.trainable == trainable
    assert dims.muon_params == sum(p.numel() for _, p in muon_parameters(d))
    assert dims.embedding + dims.verifier_head == d.embed_tokens.weight.numel() + d.verifier_lm_head.weight.numel()
    assert dims.root_unit == d.fc.weight.numel() + d.lm_head.weight.numel() + d.norm.weight.numel()


def test_kimi_draft_trains_1_19_billion_parameters():
    assert KIMI.trainable == pytest.approx(1.19e9, rel=0.01)
    assert KIMI.embedding == 163_840 * 7168 and KIMI.verifier_head == 32_000 * 7168


def test_tracker_counts_live_storages_once():
    tracker = PeakTracker()
    x = torch.zeros(1000)
    tracker.track(x)
    with tracker:
        y = x + 1  # 4 kB
        view = y[:10]  # no new storage
        y.mul_(2)  # in place: none
        z = torch.ones(2000)  # 8 kB
        del z
        w = torch.empty(0)
        w.untyped_storage().resize_(400)  # resized, as FSDP frees and refills its gathered weights
    assert tracker.peak == 4000 + 4000 + 8000
    assert tracker.current == 4000 + 4000 + 400
    del y, view
    assert tracker.current == 4000 + 400


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_is_within_a_few_percent_of_a_measured_step(tmp_path, one_thread, checkpointing):
    case = run_case(TINY, checkpointing, fsdp=False, steps=1, out=tmp_path)
    assert case.ratio == pytest.approx(1.0, abs=0.05), case


def test_plain_peak_is_the_forward_end_and_grows_with_the_pack():
    small, large = (peak_memory(TINY.dims(), TrainSetup(total_seq_len=t)) for t in (512, 2048))
    assert small.phase == large.phase == FORWARD_END
    assert large.activations > 4 * small.activations  # the CPU mask grows with the pack's square
    assert large.static == small.static


def forward_end(dims: DraftDims, setup: TrainSetup):
    return next(p for p in phase_breakdowns(dims, setup) if p.phase == FORWARD_END)


def test_fsdp_divides_the_state_and_not_the_activations():
    one, eight = (forward_end(KIMI, gpu(4096, ranks=r, fsdp=True)) for r in (1, 8))
    assert eight.weights == one.weights // 8 and eight.optimizer_state == one.optimizer_state // 8
    assert eight.frozen == one.frozen // 8
    assert eight.activations == one.activations


def test_accumulation_under_fsdp_holds_only_the_sharded_gradient():
    """Each batch is reduce-scattered into the sharded gradient: between a group's batches a rank holds
    its share (as between steps), and the backward that much more than without accumulation."""
    for checkpointing in (False, True):
        plain, accumulating = (phase_breakdowns(KIMI, gpu(2048, grad_accum=n, checkpointing=checkpointing))
                               for n in (1, 4))
        assert forward_end(KIMI, gpu(2048, grad_accum=4)).gradients == KIMI.trainable * 4 // 8
        for one, group in zip(plain, accumulating):
            assert group.total - one.total == group.gradients - one.gradients <= KIMI.trainable * 4 // 8, group.phase


def test_fsdp_layer_parts_are_attention_and_mlp():
    parts = KIMI.layer_parts(0)
    assert sum(map(sum, parts)) + KIMI.layer_norms(True) == KIMI.layer_params(0)
    attention, mlp = map(sum, parts)
    assert attention == 3 * 2 * 7168 * 8192 + 8192 * 7168 and mlp == 3 * 7168 * 18432
    assert sum(r * c for r, c in KIMI.matrix_shapes()) == KIMI.muon_params


def test_the_layers_reduce_scatters_are_its_parts_one_at_a_time():
    """The first TTT step's backward, from the MLP's reduce-scatter on, over 8 ranks: the attention still
    whole with its gradients, the MLP's retained all-gather output, the MLP's bf16 gradients, their fp32
    copy and this rank's share; a layer of one unit would hold the whole layer's."""
    step = Step.of(KIMI, gpu(2048, checkpointing=True))
    attention, mlp = map(sum, KIMI.layer_parts(0))
    assert step.reduce_scatter() == 4 * attention + 2 * mlp + mlp * (2 + 4) + mlp * 4 // 8
    whole = KIMI.layer_params(0)
    assert step.reduce_scatter() < whole * (2 + 2 + 4) + whole * 4 // 8


def test_gathers_keep_the_previous_all_gather_output_over_ranks_only():
    one, eight = (Step.of(KIMI, gpu(2048, ranks=r, fsdp=True)) for r in (1, 8))
    attention, mlp = KIMI.layer_parts(0)
    assert eight.layer_gather == (sum(attention) + 2 * sum(mlp)) * 2 and eight.retained == sum(mlp) * 2
    assert one.layer_gather == max(sum(attention) + max(attention), sum(mlp) + max(mlp)) * 2 and one.retained == 0


def test_sharded_muon_gathers_the_matrices_a_rank_owns():
    """One rank owns every matrix; over 8, each of Kimi-K2.5's 8 matrices has a rank of its own."""
    shapes = KIMI.matrix_shapes()
    one = sharded_muon_transient(KIMI, 1)
    assert one >= KIMI.muon_params * (4 + 2 + 2 + 2 + 2)
    eight = sharded_muon_transient(KIMI, 8)
    largest = max(r * c for r, c in shapes)
    assert KIMI.muon_params * 8 // 8 + 2 * largest * 2 < eight < one / 4


def test_checkpointing_keeps_a_fraction_of_the_kimi_step():
    plain, checkpointed = (peak_memory(KIMI, gpu(8192, checkpointing=c)) for c in (False, True))
    assert checkpointed.activations < 0.2 * plain.activations
    assert checkpointed.total < 0.7 * plain.total


def test_every_phase_holds_the_weights_and_the_optimizer_state():
    for checkpointing in (False, True):
        phases = phase_breakdowns(KIMI, gpu(4096, checkpointing=checkpointing))
        assert len({p.phase for p in phases}) == len(phases)
        assert all(p.weights == phases[0].weights and p.optimizer_state == phases[0].optimizer_state for p in phases)
        assert max(phases, key=lambda p: p.total) == peak_memory(KIMI, gpu(4096, checkpointing=checkpointing))


def test_setup_refuses_unknown_values():
    with pytest.raises(ValueError, match="optimizer"):
        TrainSetup(total_seq_len=8, optimizer="sgd")
    with pytest.raises(ValueError, match="at least 1"):
        dataclasses.replace(TrainSetup(total_seq_len=8), grad_accum=0)
