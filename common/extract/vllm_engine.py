"""02's `--engine vllm` (and 04 --online's): `VllmStateExtractor`, a drop-in for `StateExtractor` (same
batches, files, resume, sharding) over a vLLM worker of this process's own (common/vllm/client.py) or a
hidden-state server by URL (common/vllm/state_server.py), opened by `open_vllm_extractor`. vLLM hands
back the last layer before the final norm, which is applied here in fp32, as transformers computes it.
"""
from __future__ import annotations

import fcntl
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.engine_device import Runtime
from common.errors import PipelineError
from common.hidden_states.storage import StateStorage, StoredStates
from common.target.config import TargetInfo, read_tensors, weight_map
from common.vllm.client import EngineSettings, StateServerClient, VllmWorker


def final_norm_of(info: TargetInfo) -> tuple[torch.Tensor, float]:
    """(weight, eps) of the target's final RMSNorm, read from its checkpoint."""
    names = [n for n in weight_map(info.path) if n.endswith("model.norm.weight") and "vision" not in n]
    if len(names) != 1:
        raise PipelineError(f"target {info.path}: cannot tell its final norm among {names or 'no'} "
                            "`*model.norm.weight` tensors; use --engine hf")
    eps = getattr(info.text_config, "rms_norm_eps", None) or getattr(info.text_config, "layer_norm_epsilon", 1e-6)
    return read_tensors(info.path, names)[names[0]].float(), float(eps)


def rms_norm(states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final norm in fp32 (as transformers computes it)."""
    x = states.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


Fetch = Callable[[list[list[int]]], list[tuple[torch.Tensor, torch.Tensor]]]  # prompts -> (states, ids) each


class VllmStateExtractor:
    """The four states of each sample from vLLM: auxiliary layers `layer_ids` and layer N
    (pre-norm, vLLM's last layer output), to which the target's final norm is applied so the
    files hold the same post-norm final state as the HF engine's. `fetch` reaches the engine: a
    worker of this process (`worker_fetch`) or a hidden-state server by URL (`StateServerClient`)."""

    def __init__(self, fetch: Fetch, layer_ids: list[int], norm: tuple[torch.Tensor, float],
                 storage: StateStorage) -> None:
        self.fetch = fetch
        self.layer_ids = layer_ids
        self.norm_weight, self.eps = norm
        self.storage = storage
        self.forward_seconds = 0.0

    def __call__(self, id_lists: list[list[int]]) -> list[StoredStates]:
        start = time.perf_counter()
        fetched = self.fetch(id_lists)
        self.forward_seconds += time.perf_counter() - start
        return [self._encode(states, token_ids, ids) for (states, token_ids), ids in zip(fetched, id_lists)]

    def _encode(self, states: torch.Tensor, token_ids: torch.Tensor, ids: list[int]) -> StoredStates:
        if token_ids.tolist() != list(ids) or states.shape[:2] != (len(ids), len(self.layer_ids) + 1):
            raise PipelineError(f"vLLM gave states {tuple(states.shape)} for {token_ids.numel()} tokens, "
                                f"expected {len(ids)} tokens x {len(self.layer_ids) + 1} layers")
        aux = [states[:, j].contiguous() for j in range(len(self.layer_ids))]
        final = rms_norm(states[:, -1], self.norm_weight, self.eps)
        return StoredStates(*self.storage.encode([*aux, final]))


def worker_fetch(worker: VllmWorker) -> Fetch:
    """The states of a worker's extraction, read from the connector's files (removed after)."""
    def fetch(id_lists: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        files = worker.request({"op": "extract", "prompts": id_lists}, "hidden-state extraction")["files"]
        found = []
        for path in files:
            with _written(Path(path)) as data:
                found.append((data["hidden_states"], data["token_ids"]))
        return found
    return fetch


@contextmanager
def _written(path: Path) -> Iterator[dict[str, torch.Tensor]]:
    """A connector file once its writer has released the lock; both files are removed after."""
    lock = Path(f"{path}.lock")
    try:
        if lock.exists():
            with lock.open() as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)  # sleeps until the writer thread is done
        yield load_file(str(path), device="cpu")
    finally:
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)


@contextmanager
def open_vllm_extractor(runtime: Runtime, info: TargetInfo, trust_remote_code: bool, layer_ids: list[int],
                        storage: StateStorage, out: Path, longest: int, shard: tuple[int, int],
                        gpu_memory_utilization: float | None = None) -> Iterator[VllmStateExtractor]:
    """A `VllmStateExtractor` for the `with` block: over the hidden-state server of `runtime.vllm_url`,
    or over a worker started here, which writes its states through a scratch folder inside `out`
    (one per shard, removed at the end; one left by a killed run is removed first); `longest`
    (tokens) sizes its context; `gpu_memory_utilization` caps its share of each GPU."""
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
