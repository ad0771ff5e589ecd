"""common/vllm/worker.py, the vLLM side of `--engine vllm` (it runs in .venv-vllm's python): it imports
there; the engine settings the pipeline sends become vLLM's arguments (extraction through our CPU
connector on a CPU and vLLM's own on a GPU, an EAGLE-3 draft, the KV cache's size); the spec-decode
counters are summed over label sets; and an engine that cannot start is answered over the pipe, so
the stage names the cause in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.defaults import REPO_ROOT
from common.errors import PipelineError
from common.vllm.client import CPU_KV_CACHE_BYTES, EngineSettings, VllmWorker
from common.vllm.worker import PER_POSITION, engine_kwargs, read_counters

DRAFT = "/drafts/eagle3"


def settings(**fields) -> EngineSettings:
    return EngineSettings(**{"model": "/targets/flat", "max_model_len": 256, "trust_remote_code": False,
                             "language_model_only": False, **fields})


def sent(engine: EngineSettings) -> dict:
    """vLLM's arguments from the settings as the worker receives them (JSON on its command line)."""
    return engine_kwargs(json.loads(engine.as_json()))


@pytest.mark.vllm
def test_worker_and_connector_import_in_the_vllm_environment(vllm_python):
    """The two modules that run inside .venv-vllm (transformers 5.x, no training stack) import there."""
    probe = subprocess.run([str(vllm_python), "-c", "import common.vllm.worker, common.vllm.cpu_connector; print('ok')"],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert probe.stdout.strip().splitlines()[-1:] == ["ok"], probe.stderr[-2000:]


def test_extraction_goes_through_our_connector_on_a_cpu_and_vllms_own_on_a_gpu():
    cpu = sent(settings(device="cpu", extract_layer_ids=[2, 4, 5, 8], storage="/scratch"))
    assert cpu["speculative_config"] == {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]}}}
    assert cpu["kv_transfer_config"] == {"kv_connector": "CpuHiddenStatesConnector", "kv_role": "kv_producer",
                                         "kv_connector_extra_config": {"shared_storage_path": "/scratch"},
                                         "kv_connector_module_path": "common.vllm.cpu_connector"}
    assert cpu["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES  # not 92% of the host's memory
    assert cpu["skip_tokenizer_init"] and not cpu["enable_prefix_caching"]
    gpu = sent(settings(device="cuda", extract_layer_ids=[2, 4, 5, 8], storage="/scratch"))
    assert gpu["kv_transfer_config"] == {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                         "kv_connector_extra_config": {"shared_storage_path": "/scratch"}}
    assert "kv_cache_memory_bytes" not in gpu and gpu["speculative_config"] == cpu["speculative_config"]


def test_a_draft_is_served_as_eagle3_and_a_multimodal_target_as_its_text_model():
    served = sent(settings(device="cuda", draft=DRAFT, num_speculative_tokens=5, language_model_only=True))
    assert served["speculative_config"] == {"model": DRAFT, "method": "eagle3", "num_speculative_tokens": 5,
                                            "draft_sample_method": "greedy"}
    assert served["language_model_only"] and "kv_transfer_config" not in served
    plain = sent(settings(device="cuda"))
    assert "speculative_config" not in plain and "language_model_only" not in plain
    assert (plain["model"], plain["max_model_len"], plain["dtype"]) == ("/targets/flat", 256, "bfloat16")


def test_spec_decode_counters_are_summed_over_label_sets():
    """vLLM reports a counter per engine (label set); the per-position acceptance as vectors, which
    may differ in length."""
    def counter(name, value):
        return SimpleNamespace(name=name, value=value)

    metrics = [counter("vllm:spec_decode_num_drafts", 4), counter("vllm:spec_decode_num_drafts", 6),
               counter("vllm:spec_decode_num_draft_tokens", 30), counter("vllm:spec_decode_num_accepted_tokens", 12),
               counter("vllm:prompt_tokens", 99),  # not a spec-decode counter
               SimpleNamespace(name=PER_POSITION, values=[5, 3]), SimpleNamespace(name=PER_POSITION, values=[2, 1, 1])]
    totals = read_counters(SimpleNamespace(get_metrics=lambda: metrics))
    assert totals == {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 30,
                      "vllm:spec_decode_num_accepted_tokens": 12, PER_POSITION: [7, 4, 1]}
    assert read_counters(SimpleNamespace(get_metrics=list))[PER_POSITION] == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM imports here: it would start")
def test_an_engine_that_cannot_start_is_answered_over_the_pipe(tmp_path):
    """This environment's python has no vLLM: the worker answers its import error as JSON and the
    stage reports it in one line, naming the engine and keeping the log."""
    engine = settings(device="cpu", extract_layer_ids=[2, 4, 5, 8], storage=str(tmp_path))
    with pytest.raises(PipelineError, match=r"^vLLM extracting layers \[2, 4, 5, 8\] of /targets/flat: the engine did "
                                            r"not start: ModuleNotFoundError: No module named 'vllm'; log: ") as error:
        VllmWorker(sys.executable, engine)
    log = str(error.value).rsplit("log: ", 1)[1]
    assert Path(log).is_file()
    Path(log).unlink()
