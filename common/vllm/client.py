"""`--engine vllm`: the pipeline's side of vLLM, which runs in its own environment.

vLLM needs transformers 5.x and speculators 0.3.0 needs 4.57, so they cannot share a process.
The stages start `common/vllm/worker.py` under .venv-vllm's python (or `--vllm-python PATH`):
one offline `vllm.LLM` per engine configuration, fed token ids over a pipe, answering with
safetensors files (extraction) or token ids and vLLM's own spec-decode counters (acceptance).
This is the engine users serve with, started and stopped by the stage; a remote server is not
used because extraction needs the hidden-state connector configured at engine start and writes
on the engine's disk, and 05 needs one engine per configuration (plain, each draft).

Two uses, each behind the same shape as the HF path it replaces:
- `VllmStateExtractor`: a drop-in for `StateExtractor` in 02 (same batches, files, resume,
  sharding); vLLM hands back the last layer before the final norm, which is applied here.
- `measure_with_vllm`: 05's served acceptance length per draft, from vLLM's counters.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from safetensors.torch import load_file

from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.errors import PipelineError
from common.hidden_states.storage import StateStorage, StoredStates
from common.target.config import TargetInfo, read_tensors, weight_map

MIN_VLLM = (0, 32)  # extract_hidden_states with the hidden-state connector, as used here
CPU_KV_CACHE_BYTES = 1 << 30  # on a CPU host vLLM would otherwise reserve 92% of the host's memory
START_TIMEOUT = 900  # seconds for an engine to load (a 1T target on 8 GPUs takes minutes)
GENERIC_ERRORS = ("Engine core initialization failed", "WorkerProc initialization failed", "WorkerProc failed")

__all__ = ["add_engine_args", "EngineSettings", "VllmWorker", "VllmStateExtractor", "final_norm_of",
           "VllmMeasured", "measure_with_vllm", "engine_table"]


def add_engine_args(parser, what: str) -> None:
    """`--engine`, `--vllm-python`, `--tensor-parallel-size` for a stage."""
    group = parser.add_argument_group("engine")
    group.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                       help=f"{what} with transformers (hf, default) or with vLLM from its own environment")
    group.add_argument("--vllm-python", type=Path, default=None,
                       help=f"python of the vLLM environment (default: {DEFAULT_VLLM_PYTHON.relative_to(REPO_ROOT)}, "
                            "made by scripts/setup_vllm_env.sh)")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="vLLM: GPUs one engine spreads the target over (8 for Kimi-K2.5 on one host)")


# --- the environment and the worker process -------------------------------------------------


def check_vllm_python(flag: Path | None) -> Path:
    """The vLLM environment's python, refused in one line when absent, broken or too old."""
    python = Path(flag) if flag is not None else DEFAULT_VLLM_PYTHON
    where = f"--vllm-python {python}" if flag is not None else f"{python} (the default vLLM environment)"
    if not python.is_file():
        raise PipelineError(f"vLLM not found: no {where}; create it with `bash scripts/setup_vllm_env.sh` "
                            "or pass --vllm-python PATH")
    probe = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=300, env=_worker_env())
    if probe.returncode != 0:
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        raise PipelineError(f"vLLM does not import with {where}: {lines[-1] if lines else 'no error text'}")
    version = probe.stdout.strip().splitlines()[-1]
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < MIN_VLLM:
        raise PipelineError(f"vLLM {version} at {where} is too old: {'.'.join(map(str, MIN_VLLM))} or later needed "
                            "(requirements-vllm.txt)")
    return python


def _worker_env() -> dict[str, str]:
    # The worker imports common.vllm.worker / common.vllm.cpu_connector from this repository.
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}


@dataclass
class EngineSettings:
    """What one vLLM engine is started with (the worker's `engine_kwargs` reads these keys)."""

    model: str
    max_model_len: int
    trust_remote_code: bool
    language_model_only: bool  # a multimodal checkpoint (Kimi-K2.5): serve the text model only
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    extract_layer_ids: list[int] | None = None
    storage: str | None = None
    draft: str | None = None
    num_speculative_tokens: int = 0

    @classmethod
    def for_target(cls, info: TargetInfo, max_model_len: int, trust_remote_code: bool,
                   tensor_parallel_size: int = 1) -> EngineSettings:
        return cls(model=info.path, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                   language_model_only=info.nested, tensor_parallel_size=tensor_parallel_size)

    def as_json(self) -> str:
        data = dict(self.__dict__)
        data["kv_cache_bytes"] = CPU_KV_CACHE_BYTES if self.device == "cpu" else None
        return json.dumps(data)

    def describe(self) -> str:
        if self.extract_layer_ids:
            return f"vLLM extracting layers {self.extract_layer_ids} of {self.model}"
        if self.draft:
            return f"vLLM serving {self.model} with draft {self.draft} (k = {self.num_speculative_tokens})"
        return f"vLLM serving {self.model} without speculation"


class VllmWorker:
    """One running engine. Use as a context manager: the engine stops (and its processes end)
    on leaving, also after an error or Ctrl-C."""

    def __init__(self, python: Path, settings: EngineSettings) -> None:
        self.settings = settings
        self.failed = False  # the log is kept (and named in the error) only after a failure
        self.log = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self._log_file: IO[str] = self.log.open("w")
        start = time.perf_counter()
        self.proc = subprocess.Popen([str(python), "-m", "common.vllm.worker", settings.as_json()], cwd=REPO_ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
                                     text=True, env=_worker_env(), start_new_session=True)
        try:
            hello = self._read(f"{settings.describe()}: the engine did not start")
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - start
        self.version = hello.get("vllm")

    def request(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        return self._read(f"{self.settings.describe()}: {what} failed")

    def _read(self, failure: str) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        answer = json.loads(line) if line.strip() else {"ok": False, "error": "the engine process ended"}
        if not answer.get("ok"):
            self.failed = True
            self.close()
            cause = _log_cause(self.log)
            detail = answer.get("error", "")
            if cause and cause not in detail:
                detail = f"{cause} ({detail})" if detail else cause
            raise PipelineError(f"{failure}: {detail}; log: {self.log}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)  # its own session: the engine's spawned processes too
                self.proc.wait()
        self._log_file.close()
        if not self.failed:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        self.failed = self.failed or exc_type is not None
        self.close()


def _log_cause(log: Path) -> str | None:
    """The most specific error line of a worker's log: the last `SomethingError: text` line
    that is not one of vLLM's wrappers pointing elsewhere."""
    pattern = re.compile(r"((?:\w+\.)*\w*(?:Error|Exception)): (.+)$")
    found = None
    for line in log.read_text(errors="replace").splitlines():
        match = pattern.search(line)
        if match and not any(g in match.group(0) for g in GENERIC_ERRORS):
            found = match.group(0).strip()
    return found


# --- 02: hidden states -----------------------------------------------------------------------


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


class VllmStateExtractor:
    """The four states of each sample from vLLM: auxiliary layers `layer_ids` and layer N
    (pre-norm, vLLM's last layer output), to which the target's final norm is applied so the
    files hold the same post-norm final state as the HF engine's."""

    def __init__(self, worker: VllmWorker, layer_ids: list[int], norm: tuple[torch.Tensor, float],
                 storage: StateStorage) -> None:
        self.worker = worker
        self.layer_ids = layer_ids
        self.norm_weight, self.eps = norm
        self.storage = storage
        self.forward_seconds = 0.0

    def __call__(self, id_lists: list[list[int]]) -> list[StoredStates]:
        start = time.perf_counter()
        files = self.worker.request({"op": "extract", "prompts": id_lists}, "hidden-state extraction")["files"]
        self.forward_seconds += time.perf_counter() - start
        return [self._read(Path(path), ids) for path, ids in zip(files, id_lists)]

    def _read(self, path: Path, ids: list[int]) -> StoredStates:
        with _written(path) as data:
            states, token_ids = data["hidden_states"], data["token_ids"]
        if token_ids.tolist() != list(ids) or states.shape[:2] != (len(ids), len(self.layer_ids) + 1):
            raise PipelineError(f"vLLM wrote {path} for {token_ids.numel()} tokens and states "
                                f"{tuple(states.shape)}, expected {len(ids)} tokens x {len(self.layer_ids) + 1} layers")
        aux = [states[:, j].contiguous() for j in range(len(self.layer_ids))]
        final = rms_norm(states[:, -1], self.norm_weight, self.eps)
        return StoredStates(*self.storage.encode([*aux, final]))


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


# --- 05: served acceptance length ------------------------------------------------------------


@dataclass
class VllmMeasured:
    """One engine run over the prompts: outputs and the spec-decode counters it reported."""

    outputs: list[list[int]]
    seconds: float
    drafts: int = 0  # vllm:spec_decode_num_drafts (verification passes that carried drafts)
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # sample ids whose output differs from plain vLLM

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.drafts if self.drafts else float("nan") for n in self.accepted_per_pos]

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds if self.seconds else float("nan")

    def figures(self) -> dict[str, Any]:
        return {"measured_acceptance_length": _finite(self.acceptance_length),
                "acceptance_rate_per_position": [_finite(r) for r in self.acceptance_rate_per_position],
                "identical_to_greedy": not self.mismatched, "mismatched_samples": self.mismatched,
                "num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted, "num_accepted_tokens_per_pos": self.accepted_per_pos,
                "tokens_per_second": _finite(self.tokens_per_second), "outputs": self.outputs}


def _finite(x: float) -> float | None:
    return None if x != x else round(float(x), 6)


def _run(python: Path, settings: EngineSettings, prompts: list[list[int]], max_new_tokens: int,
         stop_ids: set[int]) -> VllmMeasured:
    with VllmWorker(python, settings) as worker:
        answer = worker.request({"op": "generate", "prompts": prompts, "max_tokens": max_new_tokens,
                                 "stop_ids": sorted(stop_ids)}, "generation")
    counters = answer["counters"]
    return VllmMeasured(outputs=answer["outputs"], seconds=answer["seconds"],
                        drafts=counters["vllm:spec_decode_num_drafts"],
                        draft_tokens=counters["vllm:spec_decode_num_draft_tokens"],
                        accepted=counters["vllm:spec_decode_num_accepted_tokens"],
                        accepted_per_pos=counters["vllm:spec_decode_num_accepted_tokens_per_pos"])


def measure_with_vllm(python: Path, base: EngineSettings, prompts: list[tuple[str, list[int]]],
                      drafts: dict[str, Path], k: int, max_new_tokens: int,
                      stop_ids: set[int]) -> tuple[VllmMeasured, dict[str, VllmMeasured]]:
    """Plain vLLM greedy decoding of (sample id, prompt ids), then each draft served with the
    target: outputs compared token by token with the plain run (temperature 0)."""
    ids = [p for _, p in prompts]
    results = {}
    for name, folder in drafts.items():  # drafts first: a draft vLLM refuses fails before the plain run
        print(f"vLLM: decoding {len(ids)} prompts with {name} ({folder})", flush=True)
        settings = EngineSettings(**{**base.__dict__, "draft": str(folder), "num_speculative_tokens": k})
        results[name] = _run(python, settings, ids, max_new_tokens, stop_ids)
        if results[name].drafts == 0:
            raise PipelineError(f"vLLM served {name} {folder} but reported no drafts: speculative decoding did not run")
    print(f"vLLM: decoding {len(ids)} prompts without speculation", flush=True)
    plain = _run(python, base, ids, max_new_tokens, stop_ids)
    for result in results.values():
        result.mismatched = [sid for (sid, _), a, b in zip(prompts, result.outputs, plain.outputs) if a != b]
    return plain, results


def engine_table(names: list[str], own: dict[str, Any], served: dict[str, VllmMeasured],
                 simulated: dict[str, float | None], k: int) -> str:
    """05's own measurement, vLLM's and the simulated figure, one column per (draft, engine)."""
    header = ["", *(f"{n} ({e})" for n in names for e in ("05", "vLLM"))]
    rows: list[list[str]] = []

    def cell(value) -> str:
        if value is None or value != value:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        return f"{value:.3f}" if isinstance(value, float) else f"{value:,}"

    def row(label: str, mine, theirs) -> None:
        rows.append([label, *(cell(v) for n in names for v in (mine(n), theirs(n)))])

    row("acceptance length", lambda n: own[n].stats.acceptance_length if own.get(n) else None,
        lambda n: served[n].acceptance_length)
    for j in range(k):
        row(f"  acceptance rate, draft {j + 1}",
            lambda n, j=j: own[n].stats.acceptance_rate_per_position[j] if own.get(n) else None,
            lambda n, j=j: served[n].acceptance_rate_per_position[j] if j < len(served[n].accepted_per_pos) else None)
    row("verification passes", lambda n: own[n].stats.passes if own.get(n) else None, lambda n: served[n].drafts)
    row("accepted tokens", lambda n: own[n].stats.accepted_total if own.get(n) else None,
        lambda n: served[n].accepted)
    row("identical to greedy", lambda n: own[n].identical_to_greedy if own.get(n) else None,
        lambda n: not served[n].mismatched)
    row("simulated acceptance length", lambda n: simulated.get(n), lambda n: None)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
