"""Helpers the tests share (the fixtures live in conftest.py): a numbered script run as a real
subprocess, `vllm serve` for the duration of a test, 00's outputs compared across engines, step
01's, 02's and 03's folders written from random data (for checks and plumbing), untrained drafts,
a packed batch, and file comparisons."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from datasets import Dataset
from safetensors.torch import save_file
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.models.eagle3 import core as eagle3_core
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from common.cli import run_main
from common.defaults import REPO_ROOT
from common.draft import patch
from common.draft.loss import DraftLoss
from common.draft.model import (
    TINY_CONFIG,
    DraftShape,
    build_draft,
    export_draft,
    read_config_file,
    speculator_config,
)
from common.hidden_states.data_config import SAMPLE_LENGTHS, DataConfig
from common.hidden_states.state_files import list_sample_files, save_sample
from common.hidden_states.storage import STORAGES
from common.prepare.prepared_dataset import PrepareReport
from common.target.config import load_target_info
from common.vocab import build_maps, make_report, write_vocab

DRAFT_K = 3  # TTT steps of the untrained drafts of random_draft
DRAFT_VOCAB = 512
BATCH_TOKENS = 160  # 02's batch budget in the tests: many small batches, so a run can be killed in the middle
# One compute thread per process: on a shared 2-core machine several processes with two spinning
# OpenMP threads each run many times slower than with one.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
KIMI_IM_END = 163586


# --- scripts and engines ----------------------------------------------------------------------


def run_script(script: str, *args: str | Path, check: bool = True, timeout: float = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python SCRIPT ARGS...` from the repository root as a real subprocess."""
    cmd = [sys.executable, str(REPO_ROOT / script), *map(str, args)]
    proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


_SCRIPTS: dict[str, ModuleType] = {}


def run_in_process(script: str, *args: str | Path, check: bool = False) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS...` as its `main(argv)` inside this process, through `run_main` as the
    script's `__main__` calls it (exit status, stdout and stderr as the process would give them), on
    one thread, from the repository root: the check of an argument or a file without ~8 s of imports
    per run. A signal, a resource limit or a lock needs a process of its own (`run_script`); an
    exception that `run_main` does not turn into a message propagates (a traceback, in a process).
    `check`: a non-zero exit fails the test with the output, as `run_script` does. Only from the test's
    own thread: stdout, stderr and the working directory are the process's."""
    if script not in _SCRIPTS:
        spec = importlib.util.spec_from_file_location(f"script_{Path(script).stem}", REPO_ROOT / script)
        _SCRIPTS[script] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_SCRIPTS[script])
    main = _SCRIPTS[script].main
    out, err = io.StringIO(), io.StringIO()
    threads, sigterm = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    torch.set_num_threads(1)
    status = 0
    try:
        with contextlib.chdir(REPO_ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_main(lambda: main([str(a) for a in args]))
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, sigterm)
    if check and status != 0:
        raise AssertionError(f"{script} exited {status}\nstdout:\n{out.getvalue()}\nstderr:\n{err.getvalue()}")
    return subprocess.CompletedProcess([script, *map(str, args)], status, out.getvalue(), err.getvalue())


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
def vllm_server(python: Path, target: Path, log: Path, *flags: str, dtype: str = "bfloat16") -> Iterator[str]:
    """`vllm serve TARGET FLAGS` (its OpenAI API server, tokenizer initialised) on a free local port,
    in `dtype` with a 1 GiB KV cache; yields its URL once it answers, stopped on leaving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--dtype", dtype,
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


def kill_after_step_checkpoint(cmd: list[str | Path], steps: Path, timeout: float = 600) -> None:
    """Start `cmd` (04, or torchrun running it), SIGKILL it and every process it started as soon
    as a step checkpoint is in place (a file, not a timer)."""
    proc = subprocess.Popen([*map(str, cmd)], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + timeout
    while not any(p.name.isdigit() for p in steps.glob("*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in [*descendants(proc.pid), proc.pid]:  # torchrun's ranks would otherwise train on
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "04 ended on its own before it was killed"


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


# --- stage folders from random data ----------------------------------------------------------


def write_prepared(folder: Path, target: Path, num: int, seed: int = 0, max_len: int = 40,
                   kimi_row: int | None = None) -> Path:
    """A prepared folder as step 01 writes it, with random ids below 4000 (live in both targets);
    row `kimi_row` ends with Kimi's `<|im_end|>`, as data tokenized for Kimi would."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len, (num,), generator=g).tolist()
    ids = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in lengths]
    if kimi_row is not None:
        ids[kimi_row][-1] = KIMI_IM_END
    masks = [(torch.rand(n, generator=g) < 0.5).long().tolist() for n in lengths]
    Dataset.from_dict({"sample_id": [f"rand-{i}" for i in range(num)], "input_ids": ids, "loss_mask": masks,
                       "num_tokens": lengths}).save_to_disk(str(folder))
    info = load_target_info(target, trust_remote_code=True)
    PrepareReport(target=info.path, tokenizer="test", vocab_size=info.vocab_size, chat_template_sha256="0" * 64,
                  max_len=max_len, inputs=["random"], samples_kept=num).save(folder)
    return folder


def extract_args(prepared: Path, target: Path, out: Path, *extra: str) -> list[str]:
    return ["--prepared", str(prepared), "--target", str(target), "--trust-remote-code", "--output", str(out),
            "--batch-tokens", str(BATCH_TOKENS), *extra]


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


# --- drafts and batches -------------------------------------------------------------------------


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


# --- comparing files --------------------------------------------------------------------------


def read_files(folder: Path) -> dict[int, dict]:
    return {i: torch.load(p, weights_only=True) for i, p in list_sample_files(folder).items()}


def assert_same_files(folder: Path, reference: Path) -> None:
    """Exactly the files of `reference`: same indices, bit-identical tensors."""
    ours, theirs = read_files(folder), read_files(reference)
    assert sorted(ours) == sorted(theirs)
    for i, data in theirs.items():
        assert torch.equal(ours[i]["input_ids"], data["input_ids"])
        assert torch.equal(ours[i]["loss_mask"], data["loss_mask"])
        assert all(torch.equal(a, b) for a, b in zip(ours[i]["hidden_states"], data["hidden_states"], strict=True)), i


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- the library's own drafts, small (tests/common/draft) ----------------------------------------

# The shape and draft vocabulary of make_draft's drafts.
DRAFT_SHAPE = DraftShape(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128)
SMALL_DRAFT_VOCAB = 256


def vocab_maps(vocab_size: int, draft_vocab: int = SMALL_DRAFT_VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """(t2d, d2t) keeping every third id, through speculators' own mapping function."""
    counts = {i * 3: 1 for i in range(draft_vocab)}
    d2t, t2d = build_vocab_mappings_from_distribution(counts, draft_vocab, vocab_size)
    return t2d, d2t


def make_draft(target, shape: DraftShape = DRAFT_SHAPE, t2d_size: int | None = None) -> Eagle3DraftModel:
    """An untrained draft on `target`, built by the library's constructor (so through whichever
    `_setup_embeddings_and_lm_heads` is installed), with every third id in its vocabulary."""
    info = load_target_info(target, trust_remote_code=True)
    t2d, d2t = vocab_maps(t2d_size or info.vocab_size)
    config = speculator_config(shape, info, SMALL_DRAFT_VOCAB, info.default_layer_ids(), speculative_tokens=3)
    torch.manual_seed(0)
    return Eagle3DraftModel(config, t2d, d2t)


def draft_inputs(seq: int = 256, hidden: int = 64, vocab: int = 4000) -> dict:
    """The keyword arguments of a draft's forward: three packed samples, then padding, 3 TTT steps."""
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, seq, 3 * hidden, generator=g),
            "input_ids": torch.randint(0, vocab, (1, seq), generator=g),
            "lengths": torch.tensor([100, 120, 30]),  # three packed samples, then padding
            "loss_mask": torch.ones(1, seq, dtype=torch.long),
            "position_ids": torch.arange(seq).unsqueeze(0),
            "verifier_last_hidden_states": torch.randn(1, seq, hidden, generator=g),
            "ttt_steps": 3}


def installed_loss() -> DraftLoss | None:
    """The `DraftLoss` whose `compute_metrics` `patch.apply` installed into the library, or None
    where it left the library's own function."""
    metrics = eagle3_core.compute_metrics
    if metrics is patch.ORIGINAL_COMPUTE_METRICS:
        return None
    assert getattr(metrics, "__func__", None) is DraftLoss.compute_metrics, metrics
    return metrics.__self__


# --- a small transformers model and a hidden-state server without vLLM ------------------------


def tiny_llama(layers: int = 4, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Llama in fp32 (hidden size 32, vocabulary 128), in eval mode: a real
    transformers causal LM small enough to build inside a test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@contextmanager
def hidden_state_server(monkeypatch, folder: Path, model: str, layer_ids: list[int], states_of) -> Iterator[str]:
    """common/vllm/state_server.py's `StateServer` on a free local port for the block (its URL), with
    vLLM's extraction (`common.vllm.worker.extract`, which needs an engine) replaced by `states_of`
    (token ids -> states [S, L, H]), written into `folder` as vLLM's connector writes them: one
    safetensors file per prompt, with its `.lock` beside it."""
    import itertools
    import threading

    from common.vllm import state_server

    count = itertools.count()

    def extract(_llm, prompts: list[list[int]]) -> dict:
        files = []
        for ids in prompts:
            path = folder / f"states-{next(count)}.safetensors"
            save_file({"hidden_states": states_of(ids), "token_ids": torch.tensor(ids)}, str(path))
            Path(f"{path}.lock").touch()
            files.append(str(path))
        return {"files": files}

    folder.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(state_server, "extract", extract)
    server = state_server.StateServer(("127.0.0.1", 0), None, {"model": model, "extract_layer_ids": layer_ids}, "test")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve of a TensorBoard folder as [(step, value), ...], read back as TensorBoard
    reads it (events a resumed run purged are gone)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def greedy_target(target: Path) -> tuple:
    """(info, fp32 model with logits, tokenizer, stop ids) of a target, for 00's engine in process."""
    from common.target.model import load_text_model
    from common.target.tokenizer import load_tokenizer

    info = load_target_info(target, trust_remote_code=True)
    model = load_text_model(info, torch.float32, "cpu", None, logits=True)
    return info, model, load_tokenizer(target, True), info.stop_ids


def engine_of(parts: tuple, batch_size: int):
    """00's HF engine over `greedy_target`'s parts: greedy, `batch_size` conversations at a time."""
    from common.regenerate.engines import HfEngine

    _, model, tokenizer, stops = parts
    return HfEngine(model, stops, tokenizer.pad_token_id or min(stops), 0.0, 1.0, batch_size)
