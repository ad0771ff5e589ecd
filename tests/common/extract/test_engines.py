"""common/extract/engines.py: the runtime picks the engine behind `open_state_engine`. The HF engine
computes the target's own states in this process (in the runtime's dtype); with a hidden-state
server's URL the states come from the server, and no engine is started here."""

from __future__ import annotations

import pytest
import torch
from helpers import hidden_state_server

from common.engine_device import Runtime
from common.extract.engines import open_state_engine
from common.extract.hf_engine import StateExtractor
from common.extract.vllm_engine import VllmStateExtractor
from common.hidden_states.storage import FP32_CHECK
from common.target.config import load_target_info
from common.target.model import load_text_model

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER_IDS = [2, 4, 5]
IDS = [[10, 20, 30, 40], [50, 60]]


def test_the_hf_engine_computes_the_targets_own_states(flat_target, tmp_path):
    info = load_target_info(flat_target)
    with open_state_engine(Runtime(), info, False, LAYER_IDS, FP32_CHECK, tmp_path / "out", 4, 1000, (0, 1)) as engine:
        assert isinstance(engine, StateExtractor) and engine.layer_ids == LAYER_IDS
        assert next(engine.base.parameters()).dtype == torch.float32
        stored = engine(IDS)
    model = load_text_model(info)
    for ids, got in zip(IDS, stored, strict=True):
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for state, layer in zip(got.states, [*LAYER_IDS, info.num_layers], strict=True):
            torch.testing.assert_close(state, hidden[layer][0], rtol=1e-4, atol=1e-4)


def test_with_a_server_url_the_states_come_from_the_server(flat_target, tmp_path, monkeypatch):
    info = load_target_info(flat_target)
    served = []

    def states_of(ids):
        served.append(ids)
        return torch.ones(len(ids), len(LAYER_IDS) + 1, info.hidden_size)

    with hidden_state_server(monkeypatch, tmp_path / "scratch", info.path, [*LAYER_IDS, 8], states_of) as url:
        runtime = Runtime(engine="vllm", vllm_url=url)  # no --vllm-python: nothing is started here
        with open_state_engine(runtime, info, False, LAYER_IDS, FP32_CHECK, tmp_path / "out", 4, 1000, (0, 1)) as engine:
            assert isinstance(engine, VllmStateExtractor)
            stored = engine(IDS)
    assert served == IDS and [s.states[0].shape for s in stored] == [(4, 64), (2, 64)]
