"""`--engine vllm`: the pipeline's side of vLLM, which runs in its own environment.

vLLM needs transformers 5.x and speculators 0.3.0 needs 4.57, so they cannot share a process.
The stages start `common/vllm/worker.py` under .venv-vllm's python (or `--vllm-python PATH`):
one offline `vllm.LLM` per engine configuration, fed token ids over a pipe, answering with
safetensors files (extraction) or token ids and vLLM's own spec-decode counters (acceptance).
This is the engine users serve with, started and stopped by the stage; a remote server is not
used because extraction needs the hidden-state connector configured at engine start and writes
on the engine's disk, and 05 needs one engine per configuration (plain, each draft).

Each stage keeps its own adapter over `VllmWorker`: 00's generation engine
(common/regenerate/engines.py), 02's state extractor (common/hidden_states/vllm_states.py) and
05's served acceptance length (common/evaluate/served.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.errors import PipelineError
from common.target.config import TargetInfo

MIN_VLLM = (0, 32)  # extract_hidden_states with the hidden-state connector, as used here
CPU_KV_CACHE_BYTES = 1 << 30  # on a CPU host vLLM would otherwise reserve 92% of the host's memory
GENERIC_ERRORS = ("Engine core initialization failed", "WorkerProc initialization failed", "WorkerProc failed")

__all__ = ["check_vllm_python", "EngineSettings", "VllmWorker"]


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
                   tensor_parallel_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> EngineSettings:
        return cls(model=info.path, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                   language_model_only=info.nested, tensor_parallel_size=tensor_parallel_size,
                   dtype=str(dtype).removeprefix("torch."))

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
