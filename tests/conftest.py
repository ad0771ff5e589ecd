"""Shared fixtures: the two miniature targets (trained once into the repository's cache, keyed by
a hash of the fixture code and corpus, and copied per session so no test can alter the cache),
the demo conversations, each target loaded with an untrained draft, a helper that runs a
numbered script as a real subprocess, and one that writes an untrained draft folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.draft import patch
from common.draft.model import TINY_CONFIG, build_draft, export_draft, read_config_file, speculator_config
from common.fixtures.targets import DEMO_CONVERSATIONS, ensure_targets
from common.target.config import load_target_info
from common.target.model import load_text_model
from common.vocab import build_maps

DRAFT_K = 3  # TTT steps of the untrained drafts below
DRAFT_VOCAB = 512


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


def random_draft(target: Path, seed: int = 0):
    """An untrained draft for `target`, with a draft vocabulary that is not the identity map."""
    patch.apply(trust_remote_code=True, compile_forward=False)
    info = load_target_info(target, trust_remote_code=True)
    counts = torch.zeros(info.vocab_size, dtype=torch.long)
    counts[:4096] = torch.randint(1, 100, (4096,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_maps(counts, DRAFT_VOCAB)
    config = speculator_config(read_config_file(TINY_CONFIG).model, info, DRAFT_VOCAB, info.default_layer_ids(),
                               DRAFT_K)
    torch.manual_seed(seed)
    return build_draft(config, t2d, d2t).eval()


def export_untrained(target: Path, out: Path, seed: int = 0) -> Path:
    """A draft folder in speculators format holding an untrained draft, through 04's exporter."""
    draft = random_draft(target, seed)
    checkpoint = out.parent / f".{out.name}-checkpoint"
    checkpoint.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(checkpoint / "model.safetensors"))
    return export_draft(checkpoint, draft.config, out)


@pytest.fixture(scope="module")
def one_thread():
    """The miniature models are too small to gain from intra-op threads, and on a shared 2-core
    machine two threads spinning against other processes make each forward pass ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models(kimi_target, flat_target):
    """(target model, info, random draft) per miniature target, loaded once."""
    loaded = {}
    for name, path in (("kimi", kimi_target), ("flat", flat_target)):
        info = load_target_info(path, trust_remote_code=True)
        loaded[name] = (load_text_model(info), info, random_draft(path))
    return loaded
