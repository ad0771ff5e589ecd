"""The engines that compute the hidden states, behind one call: the target in this process
(transformers, loaded as `Runtime` says: device map, max memory, INT4 experts kept packed;
common/extract/hf_engine.py), a vLLM worker in vLLM's own environment, or a hidden-state server by
URL (04 --online --vllm-url; both common/extract/vllm_engine.py). Each takes batches of token-id
lists and returns each sample's four states encoded for storage (`StoredStates`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.engine_device import Runtime
from common.extract.hf_engine import StateExtractor
from common.extract.vllm_engine import VllmStateExtractor, open_vllm_extractor
from common.hidden_states.storage import StateStorage
from common.target.config import TargetInfo
from common.target.model import load_text_model

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
    with open_vllm_extractor(runtime, info, trust_remote_code, layer_ids, storage, out, longest, shard,
                             gpu_memory_utilization) as extractor:
        yield extractor
