"""Shared fixtures: the miniature targets (trained once into the repository's cache, keyed by
a hash of the fixture code and corpus, and copied per session so no test can alter the cache),
the demo conversations, a helper that runs a numbered script as a real subprocess, and one that
runs `vllm serve` for the duration of a test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.fixtures.targets import DEMO_CONVERSATIONS, ensure_target, ensure_targets


def _session_copy(kind: str, tmp_path_factory) -> Path:
    # The first test that needs a target builds both at once (from an empty cache, ~12 min on 2 cores);
    # kimi-bf16 is built on the way to kimi (the INT4 one is it quantized).
    ensure_targets(["kimi", "flat"])
    return Path(shutil.copytree(ensure_target(kind), tmp_path_factory.mktemp("targets") / kind))


@pytest.fixture(scope="session")
def kimi_target(tmp_path_factory) -> Path:
    return _session_copy("kimi", tmp_path_factory)


@pytest.fixture(scope="session")
def kimi_bf16_target(tmp_path_factory) -> Path:
    """The Kimi-style miniature with bf16 routed experts (what vLLM runs on a CPU)."""
    return _session_copy("kimi-bf16", tmp_path_factory)


@pytest.fixture(scope="session")
def flat_target(tmp_path_factory) -> Path:
    return _session_copy("flat", tmp_path_factory)


@pytest.fixture(params=["kimi", "flat"])
def any_target(request) -> Path:
    """Each test using it runs once per miniature target."""
    return request.getfixturevalue(f"{request.param}_target")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM environment's python (scripts/setup_vllm_env.sh); CI sets REQUIRE_VLLM=1, which
    makes a missing one a failure instead of a skip."""
    if DEFAULT_VLLM_PYTHON.is_file():
        return DEFAULT_VLLM_PYTHON
    if os.environ.get("REQUIRE_VLLM") == "1":
        pytest.fail(f"REQUIRE_VLLM=1 but {DEFAULT_VLLM_PYTHON} is missing (bash scripts/setup_vllm_env.sh)")
    pytest.skip(f"no vLLM environment at {DEFAULT_VLLM_PYTHON} (bash scripts/setup_vllm_env.sh)")


@pytest.fixture(scope="session")
def demo_conversations() -> Path:
    return DEMO_CONVERSATIONS


def run_script(script: str, *args: str | Path, check: bool = True, timeout: float = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python SCRIPT ARGS...` from the repository root as a real subprocess."""
    cmd = [sys.executable, str(REPO_ROOT / script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def read_regenerated(folder: Path) -> list[dict]:
    """The conversations of a 00 output folder, in part order."""
    return [json.loads(line) for p in sorted(folder.glob("*.jsonl")) for line in p.read_text().splitlines()]


def assert_same_turns(hf: list[dict], served: list[dict], max_differing: float = 0.1) -> None:
    """00's conversations from two engines at temperature 0: the same conversations, and the same
    assistant turns but for rounding ties (vLLM's CPU kernels and transformers' round differently, so
    a near-tie may break the other way): at most `max_differing` of the turns may differ."""
    assert [r["id"] for r in hf] == [r["id"] for r in served] and hf
    turns = [(a, b) for x, y in zip(hf, served, strict=True) for a, b in zip(x["messages"], y["messages"])
             if a["role"] == "assistant"]
    differ = [(a, b) for a, b in turns if a != b]
    assert len(differ) <= int(len(turns) * max_differing), differ


@contextmanager
def vllm_server(python: Path, target: Path, log: Path, *flags: str) -> Iterator[str]:
    """`vllm serve TARGET FLAGS` (its OpenAI API server, tokenizer initialised) on a free local port,
    in bf16 with a 1 GiB KV cache; yields its URL once it answers, stopped on leaving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--dtype", "bfloat16",
               "--max-model-len", "512", "--port", str(port), "--kv-cache-memory-bytes", str(1 << 30),
               "--no-enable-prefix-caching", *flags]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 900
            while True:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                try:
                    urllib.request.urlopen(url + "/v1/models", timeout=5)
                    break
                except OSError:
                    time.sleep(2)
            yield url
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
