"""`--engine vllm`: the pipeline's side of vLLM, which runs in its own environment.

vLLM needs transformers 5.x and speculators 0.3.0 needs 4.57, so they cannot share a process.
The stages start `common/vllm/worker.py` under .venv-vllm's python (or `--vllm-python PATH`):
one offline `vllm.LLM` per engine configuration, fed token ids over a pipe, answering with
safetensors files (extraction) or token ids and vLLM's own spec-decode counters (acceptance).
This is the engine users serve with, started and stopped by the stage; a remote server is not
used because extraction needs the hidden-state connector configured at engine start and writes
on the engine's disk, and 05 needs one engine per configuration (plain, each draft).

Each stage keeps its own adapter over `VllmWorker`: 00's generation engine
(common/regenerate/engines.py), 02's state extractor (common/extract/vllm_engine.py) and
05's served acceptance length (common/evaluate/served.py).

Every engine start goes through `check_servable` (also callable before a stage's heavy work): what
vLLM cannot run on this host is refused there, in one line naming the cause and what works, instead
of failing after the engine's start (a minute or more).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
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

# vLLM 0.32's fused-MoE kernels for INT4 (WNA16) experts on a CPU (vllm/model_executor/layers/fused_moe/
# oracle/int_wna16.py: CPU and ZEN_CPU only) take these routing methods: softmax top-k, not
# DeepSeek-V3's sigmoid routing with a correction bias. The other WNA16 backends are GPU-only.
CPU_INT4_MOE_SCORING = ("softmax",)
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")  # vLLM's CpuArchEnum.X86 (platforms/interface.py)

__all__ = ["check_vllm_python", "check_servable", "check_sampled_speculation", "vllm_device", "EngineSettings",
           "VllmWorker"]


# --- the environment and the worker process -------------------------------------------------


def check_vllm_python(flag: Path | None) -> Path:
    """The vLLM environment's python, refused in one line when absent, broken or too old."""
    python = Path(flag) if flag is not None else DEFAULT_VLLM_PYTHON
    where = f"--vllm-python {python}" if flag is not None else f"{python} (the default vLLM environment)"
    if not python.is_file():
        raise PipelineError(f"vLLM not found: no {where}; create it with `bash scripts/setup_vllm_env.sh` "
                            "or pass --vllm-python PATH")
    probe = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=300, env=worker_env())
    if probe.returncode != 0:
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        raise PipelineError(f"vLLM does not import with {where}: {lines[-1] if lines else 'no error text'}")
    version = probe.stdout.strip().splitlines()[-1]
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < MIN_VLLM:
        raise PipelineError(f"vLLM {version} at {where} is too old: {'.'.join(map(str, MIN_VLLM))} or later needed "
                            "(requirements-vllm.txt)")
    return python


def worker_env() -> dict[str, str]:
    # The worker imports common.vllm.worker / common.vllm.cpu_connector from this repository.
    path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}


def vllm_device() -> str:
    """Where an engine started from here runs: the GPUs when this host has one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- what vLLM cannot run on this host, refused before it starts ----------------------------


def check_servable(info: TargetInfo, device: str, draft: str | Path | None = None) -> None:
    """Refuse in one line, before any engine starts, a target (served alone, or with an EAGLE-3
    `draft`) that vLLM 0.32 cannot run on `device`, as its own backend selection decides."""
    if device != "cpu":
        return
    problem = _int4_moe_on_cpu(info) or (_mla_with_draft_on_cpu(info) if draft is not None else None)
    if problem:
        what = f"vLLM serving {info.path}" + (f" with draft {draft}" if draft is not None else "")
        raise PipelineError(f"{what}: {problem}")


def check_sampled_speculation(device: str, temperature: float) -> None:
    """Refuse sampled speculative decoding on vLLM's CPU build, whose verification of sampled drafts
    is wrong: vLLM 0.32 on a CPU, the flat miniature in fp32 at temperature 0.01 (all but greedy),
    20 prompts: none of the outputs with an EAGLE-3 draft and 1 with an n-gram one equal greedy
    decoding, against 18 without speculation and 20 of 20 with either draft at temperature 0; the
    EAGLE-3 draft's acceptance length fell from 1.91 (greedy) to 1.10. Greedy verification is right
    there (05 checks it token by token); on GPUs vLLM verifies with its Triton kernels instead."""
    if device == "cpu" and temperature > 0:
        raise PipelineError(f"--engine vllm at temperature {temperature:g}: vLLM's CPU build verifies sampled drafts "
                            "wrongly (at temperature 0.01 none of 20 outputs with an EAGLE-3 draft equals greedy "
                            "decoding), so its acceptance length would mean nothing; measure sampled acceptance with "
                            "05's own decoder (without --engine vllm), or serve on a GPU")


def _int4_moe_on_cpu(info: TargetInfo) -> str | None:
    """INT4 compressed-tensors experts with a routing vLLM's CPU MoE kernels lack (Kimi-K2.5's)."""
    quant = info.quantization_config or {}
    groups = (quant.get("config_groups") or {}).values() if quant.get("quant_method") == "compressed-tensors" else ()
    int4 = any((g.get("weights") or {}).get("num_bits") == 4 for g in groups)
    experts = getattr(info.text_config, "n_routed_experts", None) or getattr(info.text_config, "num_experts", None)
    scoring = getattr(info.text_config, "scoring_func", "softmax")
    if not (int4 and experts) or scoring in CPU_INT4_MOE_SCORING:
        return None
    return (f"its routed experts are INT4 (compressed-tensors) with {scoring} routing, which no vLLM MoE kernel "
            f"runs on a CPU (its CPU kernels take INT4 experts with {'/'.join(CPU_INT4_MOE_SCORING)} routing only); "
            "on a CPU use a target with bf16 experts (the miniature: `python -m common.miniatures kimi-bf16`), "
            "or run on a GPU host")


def _mla_with_draft_on_cpu(info: TargetInfo) -> str | None:
    """An MLA target (DeepSeek-V3, Kimi-K2.5) and a draft on a CPU without AMX tiles. vLLM 0.32
    (platforms/cpu.py) then picks its reference CPU_MLA backend, which forces KV block size 16,
    while the draft's attention (CPU_ATTN) needs a multiple of 32: the engine cannot start ("No
    common block size"). With AMX (x86 and `torch.cpu._is_amx_tile_supported()`, the same call
    vLLM makes) it picks AMX_MLA, whose block sizes are multiples of 32, and both fit; with
    VLLM_MLA_DISABLE=1 the target's attention is plain CPU_ATTN too (seen starting and serving here)."""
    mla = getattr(info.text_config, "kv_lora_rank", None) is not None  # vLLM's use_mla for these model types
    if not mla or os.environ.get("VLLM_MLA_DISABLE", "0") not in ("", "0"):
        return None
    amx = _cpu_has_amx()
    if amx is None:
        print(f"warning: cannot tell whether this CPU has AMX tiles (torch {torch.__version__} has no "
              "torch.cpu._is_amx_tile_supported): without them vLLM cannot serve a draft with the MLA target "
              f"{info.path} (no common KV block size)", flush=True)
        return None
    if amx:
        return None
    return ("its attention is MLA, and on a CPU without AMX vLLM's CPU_MLA backend forces KV block size 16 while "
            "the draft's attention needs a multiple of 32 (no common block size); serve it on a GPU host or a CPU "
            "with AMX (Intel Sapphire Rapids or later), or here with VLLM_MLA_DISABLE=1 (vLLM then runs the "
            "target's attention without MLA's absorbed kernels)")


def _cpu_has_amx() -> bool | None:
    """vLLM's test for its AMX backends; None when this torch cannot tell."""
    if platform.machine().lower() not in X86_MACHINES:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else None


# --- one engine --------------------------------------------------------------------------------


@dataclass
class EngineSettings:
    """What one vLLM engine is started with (the worker's `engine_kwargs` reads these keys)."""

    model: str
    max_model_len: int
    trust_remote_code: bool
    language_model_only: bool  # a multimodal checkpoint (Kimi-K2.5): serve the text model only
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    device: str = field(default_factory=vllm_device)
    extract_layer_ids: list[int] | None = None
    storage: str | None = None
    draft: str | None = None
    num_speculative_tokens: int = 0
    draft_sample_method: str = "greedy"  # how the draft proposes when sampling (vLLM's; see common.evaluate.decoding)
    gpu_memory_utilization: float | None = None  # vLLM's share of each GPU (default: vLLM's 0.9); unused on CPU
    # A hidden-state server beside the trainer on the same GPUs (scripts/plan_kimi_k25.py --online prints
    # these): a KV cache of a fixed size instead of what the share leaves (prefill only: no decode batch to
    # hold), no CUDA graphs (they speed decoding, which it never does, and take memory), and its batch bounds.
    kv_cache_bytes: int | None = None
    enforce_eager: bool = False
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    target: TargetInfo | None = None  # the target's facts, for `check_servable` (not sent to the worker)

    @classmethod
    def for_target(cls, info: TargetInfo, max_model_len: int, trust_remote_code: bool,
                   tensor_parallel_size: int = 1, dtype: torch.dtype = torch.bfloat16) -> EngineSettings:
        return cls(model=info.path, max_model_len=max_model_len, trust_remote_code=trust_remote_code,
                   language_model_only=info.nested, tensor_parallel_size=tensor_parallel_size,
                   dtype=str(dtype).removeprefix("torch."), target=info)

    def as_json(self) -> str:
        data = {k: v for k, v in self.__dict__.items() if k != "target"}
        data["kv_cache_bytes"] = CPU_KV_CACHE_BYTES if self.device == "cpu" else self.kv_cache_bytes
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
        if settings.target is not None:
            check_servable(settings.target, settings.device, settings.draft)
        self.settings = settings
        self.failed = False  # the log is kept (and named in the error) only after a failure
        self.log = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self._log_file: IO[str] = self.log.open("w")
        start = time.perf_counter()
        self.proc = subprocess.Popen([str(python), "-m", "common.vllm.worker", settings.as_json()], cwd=REPO_ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file,
                                     text=True, env=worker_env(), start_new_session=True)
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


class StateServerClient:
    """A hidden-state server by URL (common/vllm/state_server.py, started by
    scripts/serve_hidden_states.py): its states per prompt, `(states [S, L, H], token ids [S])`. A
    request that gets no answer within `timeout` seconds (or no connection) is sent again, `retries`
    times, then fails naming the server; an error the server answers is not retried."""

    def __init__(self, url: str, timeout: float = 600.0, retries: int = 3) -> None:
        self.url, self.timeout, self.retries = url.rstrip("/"), timeout, retries

    def health(self) -> dict[str, Any]:
        return json.loads(self._call("/health", None, 30.0))

    def check(self, model: str, layer_ids: list[int]) -> None:
        """The server must extract `layer_ids` (aux ids, then N) of the same target (by folder name)."""
        health = self.health()
        if list(health.get("extract_layer_ids") or []) != list(layer_ids):
            raise PipelineError(f"hidden-state server {self.url} extracts layers {health.get('extract_layer_ids')}, "
                                f"this run needs {layer_ids}: start it with these --layer-ids")
        if Path(health.get("model", "")).name != Path(model).name:
            raise PipelineError(f"hidden-state server {self.url} serves {health.get('model')}, not {model}")

    def extract(self, prompts: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from safetensors.torch import load

        data = load(self._call("/extract", json.dumps({"prompts": prompts}).encode(), self.timeout))
        return [(data[f"states_{i}"], data[f"token_ids_{i}"]) for i in range(len(prompts))]

    def _call(self, path: str, body: bytes | None, timeout: float) -> bytes:
        request = urllib.request.Request(self.url + path, data=body,
                                         headers={"Content-Type": "application/json"} if body else {})
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=timeout) as answer:
                    return answer.read()
            except urllib.error.HTTPError as e:  # the server answered: its error, not retried
                detail = e.read().decode(errors="replace")
                try:
                    detail = json.loads(detail).get("error", detail)
                except ValueError:
                    pass
                raise PipelineError(f"hidden-state server {self.url}{path}: {e.code} {detail}") from e
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last = e
                if attempt < self.retries:
                    time.sleep(min(2.0**attempt, 10.0))
        raise PipelineError(f"hidden-state server {self.url}{path}: no answer after {self.retries + 1} attempts "
                            f"({timeout:g}s each): {last}")

