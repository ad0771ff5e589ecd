"""Shared fixtures: the two miniature targets (trained once into the repository's cache, keyed by
a hash of the fixture code and corpus, and copied per session so no test can alter the cache),
the demo conversations, and a helper that runs a numbered script as a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.data.loss_mask import ChatMasker
from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.fixtures.targets import DEMO_CONVERSATIONS, ensure_targets


def _session_copy(kind: str, tmp_path_factory) -> Path:
    # The first test that needs a target builds both at once (from an empty cache, ~12 min on 2 cores).
    cached = ensure_targets(["kimi", "flat"])[kind]
    return Path(shutil.copytree(cached, tmp_path_factory.mktemp("targets") / kind))


@pytest.fixture(scope="session")
def kimi_target(tmp_path_factory) -> Path:
    return _session_copy("kimi", tmp_path_factory)


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
def tokenizers(kimi_target, flat_target) -> dict:
    """Each miniature target's tokenizer, loaded once (step 01's masks and ids are built from them)."""
    return {"kimi": AutoTokenizer.from_pretrained(kimi_target, trust_remote_code=True),
            "flat": AutoTokenizer.from_pretrained(flat_target)}


@pytest.fixture(scope="session")
def maskers(tokenizers) -> dict:
    """A `ChatMasker` per miniature target (its template analysis and encode-path probes run once)."""
    return {kind: ChatMasker(tok) for kind, tok in tokenizers.items()}


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
