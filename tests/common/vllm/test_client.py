"""common/vllm/client.py: what vLLM 0.32 cannot run on a CPU is refused before any engine starts
(INT4 compressed-tensors experts with DeepSeek-V3 routing; an MLA target with a draft on a CPU
without AMX tiles), by the decision vLLM's own backend selection makes; what it can run passes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from common.defaults import REPO_ROOT
from common.errors import PipelineError
from common.target.config import load_target_info
from common.vllm.client import EngineSettings, VllmWorker, check_servable

DRAFT = Path("/drafts/eagle3")  # only its presence matters: an EAGLE-3 draft's attention is Llama-style


@pytest.fixture(scope="module")
def infos(kimi_target, kimi_bf16_target, flat_target):
    return {kind: load_target_info(path, trust_remote_code=True) for kind, path in
            (("kimi", kimi_target), ("kimi-bf16", kimi_bf16_target), ("flat", flat_target))}


def with_amx(monkeypatch, answer: bool | None) -> None:
    """This host's answer to vLLM's AMX test (none here has AMX tiles: the AMX side cannot run)."""
    if answer is None:
        monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    else:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: answer)


def test_int4_experts_are_refused_on_a_cpu_only(infos):
    with pytest.raises(PipelineError, match=r"routed experts are INT4 \(compressed-tensors\) with sigmoid routing"
                                            r".*kimi-bf16.*GPU host"):
        check_servable(infos["kimi"], "cpu")
    check_servable(infos["kimi"], "cuda")
    check_servable(infos["kimi-bf16"], "cpu")
    check_servable(infos["flat"], "cpu", DRAFT)


def test_an_mla_target_with_a_draft_needs_amx_on_a_cpu(infos, monkeypatch):
    with_amx(monkeypatch, False)
    with pytest.raises(PipelineError, match=f"with draft {DRAFT}: .*MLA.*block size 16.*multiple of 32.*GPU host.*VLLM_MLA_DISABLE=1"):
        check_servable(infos["kimi-bf16"], "cpu", DRAFT)
    check_servable(infos["kimi-bf16"], "cpu")  # served alone (00, 02's extraction): one backend, no conflict
    check_servable(infos["kimi-bf16"], "cuda", DRAFT)
    with_amx(monkeypatch, True)  # vLLM picks AMX_MLA, whose block sizes are multiples of 32
    check_servable(infos["kimi-bf16"], "cpu", DRAFT)


def test_vllm_mla_disable_lets_a_draft_be_served_on_any_cpu(infos, monkeypatch):
    with_amx(monkeypatch, False)
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")  # the target's attention is then CPU_ATTN as well
    check_servable(infos["kimi-bf16"], "cpu", DRAFT)


def test_without_an_amx_answer_it_says_it_cannot_tell(infos, monkeypatch, capsys):
    with_amx(monkeypatch, None)
    check_servable(infos["kimi-bf16"], "cpu", DRAFT)
    assert "cannot tell whether this CPU has AMX tiles" in capsys.readouterr().out


def test_the_worker_checks_before_starting_anything(infos, monkeypatch, tmp_path):
    """VllmWorker refuses before it starts the engine process (no python is run)."""
    with_amx(monkeypatch, False)
    settings = EngineSettings.for_target(infos["kimi-bf16"], 64, True)
    settings.device, settings.draft = "cpu", str(DRAFT)
    with pytest.raises(PipelineError, match="no common block size"):
        VllmWorker(tmp_path / "no-python", settings)
    assert "target" not in json.loads(settings.as_json())  # the worker gets engine arguments only


SAMPLED_REQUESTS = """
import json
from common.vllm import worker

class Engine:  # what generate() hands vLLM, without starting an engine
    def generate(self, prompts, params, use_tqdm):
        self.params = params
        return []
    def get_metrics(self):
        return []

engine = Engine()
worker.generate(engine, [[1, 2], [3]], 8, [2], 0.7, 0.9, 5)
sampled = [(p.temperature, p.top_p, p.seed, p.stop_token_ids) for p in engine.params]
worker.generate(engine, [[1, 2]], 8, [2])
print(json.dumps({"sampled": sampled, "greedy": [(p.temperature, p.seed) for p in engine.params]}))
"""


@pytest.mark.vllm
def test_05s_sampling_and_draft_rule_reach_vllm(vllm_python, infos):
    """05 at a temperature: vLLM's requests carry its temperature, top-p and a seed per prompt
    (greedy ones none), and the draft proposes by 05's --draft-sampling (vLLM's draft_sample_method)."""
    from common.vllm.worker import engine_kwargs

    settings = EngineSettings.for_target(infos["flat"], 256, False)
    settings.draft, settings.num_speculative_tokens = str(DRAFT), 3
    assert engine_kwargs(json.loads(settings.as_json()))["speculative_config"]["draft_sample_method"] == "greedy"
    settings.draft_sample_method = "probabilistic"
    assert engine_kwargs(json.loads(settings.as_json()))["speculative_config"]["draft_sample_method"] == "probabilistic"
    probe = subprocess.run([str(vllm_python), "-c", SAMPLED_REQUESTS], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=600)
    sent = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else probe.stderr[-2000:]
    assert sent == {"sampled": [[0.7, 0.9, 5, [2]], [0.7, 0.9, 6, [2]]], "greedy": [[0.0, None]]}


def test_the_engine_s_share_of_each_gpu_reaches_vllm_on_a_gpu_only(infos):
    """04 --online --gpu-memory-utilization: vLLM takes that share of each GPU (the draft trains in the
    rest); on a CPU the KV cache stays a fixed size."""
    from common.vllm.worker import engine_kwargs

    settings = EngineSettings.for_target(infos["flat"], 256, False)
    settings.gpu_memory_utilization = 0.55
    for device, expected in (("cuda", {"gpu_memory_utilization": 0.55}), ("cpu", {})):
        settings.device = device
        kwargs = engine_kwargs(json.loads(settings.as_json()))
        assert {k: kwargs[k] for k in ("gpu_memory_utilization",) if k in kwargs} == expected
        assert ("kv_cache_memory_bytes" in kwargs) == (device == "cpu")


def test_a_server_beside_the_trainer_gets_the_plans_engine_settings(infos):
    """serve_hidden_states.py's --kv-cache-memory-bytes, --enforce-eager, --max-num-batched-tokens and
    --max-num-seqs reach vLLM on a GPU; unset, vLLM's defaults stand."""
    from common.vllm.worker import engine_kwargs

    settings = EngineSettings.for_target(infos["flat"], 2049, False)
    settings.device = "cuda"
    keys = ("kv_cache_memory_bytes", "enforce_eager", "max_num_batched_tokens", "max_num_seqs")
    assert not set(keys) & set(engine_kwargs(json.loads(settings.as_json())))
    settings.kv_cache_bytes, settings.enforce_eager = 575_668_224, True
    settings.max_num_batched_tokens, settings.max_num_seqs = 4096, 16
    kwargs = engine_kwargs(json.loads(settings.as_json()))
    assert [kwargs[k] for k in keys] == [575_668_224, True, 4096, 16]


def test_a_server_that_does_not_answer_is_retried_then_named(tmp_path):
    """A hidden-state server that accepts the connection and never answers (a hung engine): each
    request times out, is sent again `retries` times, then fails in one line naming the server."""
    import socket
    import time

    from common.vllm.client import StateServerClient

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(PipelineError) as error:
            StateServerClient(url, timeout=0.3, retries=2).extract([[1, 2, 3]])
        elapsed = time.monotonic() - start
    assert str(error.value).startswith(f"hidden-state server {url}/extract: no answer after 3 attempts (0.3s each)")
    assert 3 * 0.3 + 1 + 2 <= elapsed < 30  # three timeouts and the back-off between them
