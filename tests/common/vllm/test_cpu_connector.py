"""common/vllm/cpu_connector.py (runs inside vLLM's engine, in .venv-vllm): the CPU copy of a finished
request's states. The rows of its KV-cache blocks, in block order and cut at its token count, are
written for the library's own reader, which waits on the lock until the write is done; the request is
marked copied at once (no CUDA event on a CPU host). The engine's configuration is not needed for the
write, so the connector is built without one (no engine starts)."""

from __future__ import annotations

import json
import subprocess

import pytest

from common.defaults import REPO_ROOT

pytestmark = pytest.mark.vllm

WRITE_ONE_REQUEST = """
import fcntl, json, os, sys
from concurrent.futures import ThreadPoolExecutor

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    PendingSave, load_hidden_states)

from common.vllm.cpu_connector import CpuHiddenStatesConnector

connector = object.__new__(CpuHiddenStatesConnector)
connector._is_tp_rank_zero, connector._block_size = True, 4
# KV cache [blocks, layers, block size, hidden]: each row says where it is, block * 1000 + offset * 10 + layer
cache = torch.zeros(5, 3, 4, 2)
for block in range(5):
    for layer in range(3):
        for offset in range(4):
            cache[block, layer, offset] = block * 1000 + offset * 10 + layer
connector._kv_cache = cache
connector._executor = ThreadPoolExecutor(2)
connector._lock_fds, connector._req_futures, connector._req_copy_events = {}, {}, {}
path = os.path.join(sys.argv[1], "request", "states.safetensors")
os.makedirs(os.path.dirname(path))
lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
fcntl.flock(lock, fcntl.LOCK_EX)  # as the connector takes it when the request arrives
connector._lock_fds["req-1"] = lock
# six tokens in blocks 3 then 1: the four rows of block 3, the first two of block 1
connector._submit_async_write(PendingSave("req-1", path, torch.tensor([7, 8, 9, 10, 11, 12]), [3, 1]))
data = load_hidden_states(path)
connector._executor.shutdown()
print(json.dumps({"states": data["hidden_states"][:, :, 0].tolist(), "hidden": data["hidden_states"].shape[-1],
                  "token_ids": data["token_ids"].tolist(), "copied": connector._req_copy_events["req-1"].query(),
                  "locks_held": len(connector._lock_fds)}))
"""


def test_a_finished_requests_rows_are_written_for_the_librarys_reader(vllm_python, tmp_path):
    probe = subprocess.run([str(vllm_python), "-c", WRITE_ONE_REQUEST, str(tmp_path)], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    written = json.loads(probe.stdout.strip().splitlines()[-1])
    rows = [(3, offset) for offset in range(4)] + [(1, 0), (1, 1)]
    assert written["states"] == [[block * 1000 + offset * 10 + layer for layer in range(3)] for block, offset in rows]
    assert written["hidden"] == 2 and written["token_ids"] == [7, 8, 9, 10, 11, 12]
    assert written["copied"] and written["locks_held"] == 0
