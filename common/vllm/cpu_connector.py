"""vLLM's hidden-state connector with plain CPU copies (loaded by vLLM, in .venv-vllm).

vLLM 0.32's `ExampleHiddenStatesConnector` copies the cached states out on a CUDA stream into
pinned memory and marks completion with CUDA events: none of that exists on a CPU host. This
subclass copies synchronously and hands the write to the same thread pool and file lock, so the
reader side (`load_hidden_states`, waiting on the lock) is the library's own. On a GPU host the
library's connector is used instead (see common/vllm/worker.py).
"""

from __future__ import annotations

import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event of a copy that has already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(self._write_tensors, tensors, _Done(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
