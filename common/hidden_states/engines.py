"""The engines that compute the hidden states, behind one call: the target in this process
(transformers, loaded as `Runtime` says: device map, max memory, INT4 experts kept packed), a
vLLM worker in vLLM's own environment (common/vllm/client.py), or a hidden-state server by URL
(common/vllm/state_server.py; 04 --online --vllm-url). Both take batches of token-id lists
and return each sample's four states encoded for storage (`StoredStates`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.engine_device import Runtime
from common.hidden_states.capture import StateExtractor
from common.hidden_states.storage import StateStorage
from common.hidden_states.vllm_states import VllmStateExtractor, final_norm_of, worker_fetch
from common.target.config import TargetInfo
from common.target.model import load_text_model
from common.vllm.client import EngineSettings, StateServerClient, VllmWorker

__all__ = ["open_state_engine"]


@contextmanager
def open_state_engine(runtime: Runtime, info: TargetInfo, trust_remote_code: bool, layer_ids: list[int],
                      storage: StateStorage, out: Path, longest: int, batch_tokens: int,
                      shard: tuple[int, int], gpu_memory_utilization: float | None = None
                      ) -> Iterator[StateExtractor | VllmStateExtractor]:
    """The engine of `runtime`, open for the `with` block. vLLM writes its states through a scratch
    folder inside `out` (one per shard, removed at the end; one left by a killed run is removed
    first); `longest` (tokens) sizes its context; `gpu_memory_utilization` caps its share of each GPU
    (04 --online trains beside it)."""
    if not runtime.vllm:
        model = load_text_model(info, runtime.dtype, runtime.device, runtime.device_map, runtime.max_memory,
                                batch_tokens)
        yield StateExtractor(model, layer_ids, storage)
        return
    if runtime.vllm_url:  # a hidden-state server started apart (scripts/serve_hidden_states.py)
        server = StateServerClient(runtime.vllm_url)
        server.check(info.path, [*layer_ids, info.num_layers])
        yield VllmStateExtractor(server.extract, layer_ids, final_norm_of(info), storage)
        return
    settings = EngineSettings.for_target(info, longest + 1, trust_remote_code, runtime.tensor_parallel_size,
                                         runtime.vllm_dtype)
    scratch = f".vllm-states-{shard[0]}-of-{shard[1]}-"
    out.mkdir(parents=True, exist_ok=True)  # 04 --online --output NEW: its folder is made here first
    for stale in out.glob(scratch + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=scratch, dir=out) as scratch_dir:
        settings.extract_layer_ids, settings.storage = [*layer_ids, info.num_layers], scratch_dir
        settings.gpu_memory_utilization = gpu_memory_utilization
        with VllmWorker(runtime.vllm_python, settings) as worker:
            print(f"vLLM {worker.version} started in {worker.start_seconds:,.0f}s")
            yield VllmStateExtractor(worker_fetch(worker), layer_ids, final_norm_of(info), storage)
