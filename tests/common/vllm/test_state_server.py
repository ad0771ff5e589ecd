"""common/vllm/state_server.py with common/vllm/client.py's `StateServerClient`, over HTTP on this host
(vLLM's extraction, which needs an engine, replaced by states written as its connector writes them):
each prompt's states and ids come back in order and the connector's files are deleted once sent; the
health answer names the model and layers the client checks; an engine error is answered, named and
not retried; a connector file is read only once its writer has released the lock."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers import hidden_state_server
from safetensors.torch import save_file

from common.errors import PipelineError
from common.vllm.client import StateServerClient
from common.vllm.state_server import read_states

LAYERS = [2, 4, 5, 8]  # three auxiliary layers and N, as 04 --online --vllm-url asks for them
HIDDEN = 16


def states_of(ids: list[int]) -> torch.Tensor:
    """Distinct states per prompt and position: [S, L, H], each entry derived from its token id."""
    ids_t = torch.tensor(ids, dtype=torch.float32)
    return ids_t[:, None, None] + torch.arange(len(LAYERS))[None, :, None] / 10 + torch.zeros(1, 1, HIDDEN)


def test_each_prompts_states_come_back_in_order_and_the_files_go(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    with hidden_state_server(monkeypatch, scratch, "/targets/flat", LAYERS, states_of) as url:
        prompts = [[5, 6, 7], [9], [1, 2]]
        fetched = StateServerClient(url).extract(prompts)
    assert len(fetched) == 3
    for ids, (states, token_ids) in zip(prompts, fetched, strict=True):
        assert token_ids.tolist() == ids
        assert torch.equal(states, states_of(ids))
    assert not list(scratch.iterdir())  # each file and its lock deleted once sent


def test_the_client_checks_the_servers_model_and_layers(tmp_path, monkeypatch):
    with hidden_state_server(monkeypatch, tmp_path, "/models/flat", LAYERS, states_of) as url:
        client = StateServerClient(url)
        assert client.health() == {"ok": True, "vllm": "test", "model": "/models/flat", "extract_layer_ids": LAYERS}
        client.check("/elsewhere/flat", LAYERS)  # the same target by folder name
        with pytest.raises(PipelineError, match=rf"^hidden-state server {url} extracts layers \[2, 4, 5, 8\], this run "
                                                r"needs \[1, 2, 3, 8\]: start it with these --layer-ids"):
            client.check("/models/flat", [1, 2, 3, 8])
        with pytest.raises(PipelineError, match=rf"^hidden-state server {url} serves /models/flat, not /models/kimi"):
            client.check("/models/kimi", LAYERS)
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url + "/metrics", timeout=30)
        assert missing.value.code == 404 and json.loads(missing.value.read())["error"] == "no /metrics"


def test_an_engine_error_is_answered_named_and_not_retried(tmp_path, monkeypatch):
    def failing(ids: list[int]) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    with hidden_state_server(monkeypatch, tmp_path, "/models/flat", LAYERS, failing) as url:
        start = time.monotonic()
        with pytest.raises(PipelineError) as error:
            StateServerClient(url, retries=3).extract([[1, 2]])
        elapsed = time.monotonic() - start
        assert StateServerClient(url).health()["ok"]  # the server goes on serving
    assert str(error.value) == (f"hidden-state server {url}/extract: 500 RuntimeError: CUDA error: an illegal memory "
                                "access was encountered")
    assert elapsed < 1  # a retry would first wait a second


def test_a_connector_file_is_read_once_its_writer_releases_the_lock(tmp_path):
    path = tmp_path / "states.safetensors"
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as vLLM's connector holds it while its writer thread works
    result: dict = {}
    reader = threading.Thread(target=lambda: result.update(read_states(str(path))))
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive() and not result  # waiting, not reading a file still being written
    save_file({"hidden_states": states_of([3, 4]), "token_ids": torch.tensor([3, 4])}, str(path))
    os.close(lock)  # the writer is done
    reader.join(timeout=30)
    assert result["token_ids"].tolist() == [3, 4] and torch.equal(result["hidden_states"], states_of([3, 4]))
    assert not list(tmp_path.iterdir())
