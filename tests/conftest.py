"""Shared fixtures: the miniature targets (trained once into the repository's cache, keyed by
a hash of the fixture code and corpus, and copied per session so no test can alter the cache),
the demo conversations, each target loaded with an untrained draft, a helper that runs a numbered
script as a real subprocess, one that runs `vllm serve` for the duration of a test, two that write
step 02's and step 03's folders from random states (for checks and plumbing), and one that writes
an untrained draft folder."""

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
import torch
from safetensors.torch import save_file
from speculators.models.eagle3 import Eagle3DraftModel
from transformers import AutoTokenizer

from common.data.loss_mask import ChatMasker
from common.defaults import DEFAULT_VLLM_PYTHON, REPO_ROOT
from common.draft import patch
from common.draft.model import TINY_CONFIG, build_draft, export_draft, read_config_file, speculator_config
from common.fixtures.targets import DEMO_CONVERSATIONS, ensure_target, ensure_targets
from common.hidden_states.files import SAMPLE_LENGTHS, DataConfig, save_sample
from common.hidden_states.storage import STORAGES
from common.target.config import load_target_info
from common.target.model import load_text_model
from common.vocab import build_maps, make_report, write_vocab

DRAFT_K = 3  # TTT steps of the untrained drafts of random_draft
DRAFT_VOCAB = 512


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


def read_regenerated(folder: Path) -> list[dict]:
    """The conversations of a 00 output folder, in part order."""
    return [json.loads(line) for p in sorted(folder.glob("*.jsonl")) for line in p.read_text().splitlines()]


def assert_same_turns(hf: list[dict], served: list[dict]) -> None:
    """00's conversations from two engines at temperature 0: the same conversations, and the same
    assistant turns but for rounding ties (vLLM's CPU kernels and transformers' round differently, so
    a near-tie may break the other way): at most one turn in ten may differ."""
    assert [r["id"] for r in hf] == [r["id"] for r in served] and hf
    turns = [(a, b) for x, y in zip(hf, served, strict=True) for a, b in zip(x["messages"], y["messages"])
             if a["role"] == "assistant"]
    differ = [(a, b) for a, b in turns if a != b]
    assert len(differ) <= len(turns) // 10, differ


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


def write_hidden_states(folder: Path, target: Path, num_samples: int, hidden: int | None = None,
                        length: int = 48, seed: int = 0, storage: str = "bf16") -> Path:
    """A hidden-state folder as step 02 writes it, with random states (for checks and plumbing)."""
    info = load_target_info(target, trust_remote_code=True)
    hidden = hidden or info.hidden_size
    g = torch.Generator().manual_seed(seed)
    lengths = {}
    for i in range(num_samples):
        n = length + i % 7
        ids = torch.randint(0, min(info.vocab_size, 3000), (n,), generator=g)
        states, scales = STORAGES[storage].encode([torch.randn(n, hidden, generator=g) for _ in range(4)])
        save_sample(folder, i, ids, states, torch.ones(n, dtype=torch.long), scales)
        lengths[str(i)] = n
    (folder / SAMPLE_LENGTHS).write_text(json.dumps(lengths))
    DataConfig(target=info.path, architecture=info.architecture, text_architecture=info.text_architecture,
               hidden_size=hidden, num_layers=info.num_layers, vocab_size=info.vocab_size,
               layer_ids=info.default_layer_ids(), compute_dtype="float32", max_len=4096, prepared="test",
               tokenizer="test", chat_template_sha256="0", sample_count=num_samples, storage=storage,
               dtype=STORAGES[storage].dtype_name).save(folder)
    return folder


def write_vocab_folder(folder: Path, vocab_size: int, draft_vocab: int = 200) -> Path:
    counts = falling_counts(vocab_size, draft_vocab)
    d2t, t2d = build_maps(counts, draft_vocab)
    write_vocab(folder, d2t, t2d, counts, make_report(counts, t2d, target="test", prepared="test", samples=1))
    return folder


def falling_counts(vocab_size: int, draft_vocab: int) -> torch.Tensor:
    """Token counts that make ids 0..draft_vocab-1 the draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    counts[: draft_vocab * 2] = torch.arange(draft_vocab * 2, 0, -1)
    return counts


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


def packed_batch(seed: int, length: int = 24, hidden: int = 64) -> dict[str, torch.Tensor]:
    """A batch as the library's collate packs two samples, from random states."""
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(1, length, 3 * hidden, generator=g),
            "input_ids": torch.randint(0, 400, (1, length), generator=g),
            "verifier_last_hidden_states": torch.randn(1, length, hidden, generator=g),
            "loss_mask": torch.ones(1, length, dtype=torch.long), "lengths": torch.tensor([10, length - 10]),
            "position_ids": torch.cat([torch.arange(10), torch.arange(length - 10)]).unsqueeze(0)}


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
