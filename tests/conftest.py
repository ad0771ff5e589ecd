"""Shared fixtures: the two miniature targets (generated once per test session, deterministic),
the demo conversations, and a helper that runs a numbered script as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.fixtures import DEMO_CONVERSATIONS, REPO_ROOT, write_flat_target, write_kimi_target


@pytest.fixture(scope="session")
def kimi_target(tmp_path_factory) -> Path:
    return write_kimi_target(tmp_path_factory.mktemp("targets") / "kimi")


@pytest.fixture(scope="session")
def flat_target(tmp_path_factory) -> Path:
    return write_flat_target(tmp_path_factory.mktemp("targets") / "flat")


@pytest.fixture(params=["kimi", "flat"])
def any_target(request) -> Path:
    """Each test using it runs once per miniature target."""
    return request.getfixturevalue(f"{request.param}_target")


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
