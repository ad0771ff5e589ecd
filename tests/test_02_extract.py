"""Step 02: hidden-state capture against a plain forward, batching, the v1 files and their
folder (speculators' own dataset loads it), its curves in the experiment trackers, resume after
SIGKILL, shards, failures, bad input."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import (
    BATCH_TOKENS,
    KIMI_IM_END,
    ONE_THREAD,
    assert_same_files,
    extract_args,
    folder_digest,
    read_files,
    run_in_process,
    run_script,
    write_prepared,
)
from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.defaults import REPO_ROOT
from common.errors import PipelineError
from common.extract.batches import estimate_bytes, plan_batches
from common.extract.hf_engine import StateExtractor
from common.extract.verify import verify_samples
from common.hidden_states.data_config import DATA_CONFIG, SAMPLE_LENGTHS, DataConfig
from common.hidden_states.state_files import list_sample_files, sample_path
from common.hidden_states.storage import FP32_CHECK, SCALES_KEY, STORAGES
from common.target.config import load_target_info
from common.target.int4_experts import PackedLinear, dequantize_packed
from common.target.model import load_text_model
from common.trackers import TENSORBOARD_DIR

SCRIPT = "02_extract_hidden_states.py"
NUM_SAMPLES = 32
VERIFIED = range(0, NUM_SAMPLES, 4)  # samples checked against a plain forward (slow on CPU for Kimi's vocabulary)
SCALARS = ("extract/tokens_per_s", "extract/samples_written", "extract/samples_failed", "extract/bytes_written",
           "extract/forward_share")


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the event files in `folder` as TensorBoard reads them (what a
    resumed run purged left out)."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def random_ids(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 4000, (n,), generator=g).tolist() for n in lengths]


def load_script():
    spec = importlib.util.spec_from_file_location("extract_hidden_states", REPO_ROOT / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(kimi_target, flat_target) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each miniature target in fp32 on the CPU, loaded once."""
    return {name: (path, load_text_model(load_target_info(path, trust_remote_code=True)))
            for name, path in (("kimi", kimi_target), ("flat", flat_target))}


@pytest.fixture(scope="module")
def extracted(models, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(prepared folder, hidden-state folder) of one uninterrupted run of the script per target,
    reporting to TensorBoard: asked to (kimi), by default (flat)."""
    runs = {}
    for name, (target, _model) in models.items():
        root = tmp_path_factory.mktemp(f"extract-{name}")
        prepared = write_prepared(root / "prepared", target, NUM_SAMPLES)
        report = ["--report-to", "tensorboard"] if name == "kimi" else []
        run_in_process(SCRIPT, *extract_args(prepared, target, root / "hs", *report), check=True)
        runs[name] = prepared, root / "hs"
    return runs


# --- capture: batched equals sample by sample; the states are the target's own ---------------


@pytest.mark.parametrize("name", ["kimi", "flat"])
def test_batched_equals_sample_by_sample(models, name):
    _path, model = models[name]
    ids = random_ids([37, 5, 21, 1, 30])
    extractor = StateExtractor(model, [2, 4, 5], storage=FP32_CHECK)
    batched = extractor(ids)
    for sample, stored in zip(ids, batched, strict=True):
        (alone,) = extractor([sample])
        assert [s.shape for s in stored.states] == [(len(sample), 64)] * 4 and stored.scales is None
        # fp32 sums in another order, and in the MoE a top-k near-tie in the router may pick another
        # expert for a token (seen: 0.2% of a state's scale); padding leaking in would be O(1).
        for a, b in zip(stored.states, alone.states, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["kimi", "flat"])
def test_captured_states_are_the_targets_own(models, name):
    """Kept in fp32: lm_head(final state) gives the target's logits (same argmax everywhere)
    and aux state i is hidden_states[i] of a plain forward."""
    _path, model = models[name]
    ids = random_ids([40, 17, 3])
    stored = StateExtractor(model, [2, 4, 5], storage=FP32_CHECK)(ids)
    check = verify_samples(model, [(i, s.states) for i, s in zip(ids, stored)], [2, 4, 5])
    assert check.argmax_agreement == 1.0
    assert check.max_logit_diff < 1e-3 and check.max_aux_error < 1e-5


# --- the files of a run ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kimi", "flat"])
def test_files_match_target_and_prepared_rows(models, extracted, name):
    _path, model = models[name]
    prepared, out = extracted[name]
    rows = Dataset.load_from_disk(str(prepared))
    files = read_files(out)
    assert sorted(files) == list(range(NUM_SAMPLES))
    pairs = []
    for i, data in files.items():
        assert set(data) == {"input_ids", "hidden_states", "loss_mask"}
        assert data["input_ids"].dtype == data["loss_mask"].dtype == torch.int64
        assert data["input_ids"].tolist() == rows[i]["input_ids"] and data["loss_mask"].tolist() == rows[i]["loss_mask"]
        states = data["hidden_states"]
        size = len(rows[i]["input_ids"])
        assert len(states) == 4 and all(s.dtype == torch.bfloat16 and s.shape == (size, 64) for s in states)
        # Each state owns exactly its bytes (no padded batch behind a view): 4 x hidden x 2 per token.
        assert sum(s.untyped_storage().nbytes() for s in states) == size * 4 * 64 * 2
        if i in VERIFIED:
            pairs.append((rows[i]["input_ids"], states))
    # bf16 storage: logits close, a different argmax only at a near-tie within that error. The
    # reference is the same model with its INT4 experts (Kimi) dequantized to fp32 weights.
    assert (name == "kimi") == any(isinstance(m, PackedLinear) for m in model.modules())
    check = verify_samples(dequantize_packed(copy.deepcopy(model)), pairs, [2, 4, 5])
    assert check.max_logit_diff < 0.1 and check.unexplained_mismatches == 0 and check.argmax_agreement > 0.97
    assert check.max_aux_error < 2**-7


@pytest.mark.parametrize("name", ["kimi", "flat"])
def test_manifest_files_and_speculators_dataset(extracted, name):
    prepared, out = extracted[name]
    rows = Dataset.load_from_disk(str(prepared))
    lengths = json.loads((out / SAMPLE_LENGTHS).read_text())
    assert lengths == {str(i): len(rows[i]["input_ids"]) for i in range(NUM_SAMPLES)}
    config = json.loads((out / DATA_CONFIG).read_text())
    assert config["layer_ids"] == [2, 4, 5] and config["last_state"] == "post_norm"
    assert config["hidden_size"] == 64 and config["num_layers"] == 8 and config["dtype"] == "bfloat16"
    assert config["sample_count"] == NUM_SAMPLES and config["token_count"] == sum(lengths.values())
    assert config["failed"] == [] and config["max_len"] == 40 and config["package_versions"]["speculators"] == "0.3.0"
    assert [p.name for p in out.rglob("*pt")] and all(p.name.startswith("data_") for p in out.rglob("*pt"))

    dataset = Eagle3SampleFileDataset(max_len=64, datapath=str(out))
    assert len(dataset) == NUM_SAMPLES
    item = dataset[0]
    size = item["input_ids"].shape[0]
    assert item["hidden_states"].shape == (size, 3 * 64) and item["verifier_last_hidden_states"].shape == (size, 64)
    batch = create_collate_fn(64)([dataset[i] for i in range(3)])
    assert batch["hidden_states"].shape == (1, 64, 3 * 64)


@pytest.mark.parametrize("name", ["kimi", "flat"])
def test_progress_goes_to_tensorboard(extracted, name):
    """RUN/tensorboard/extract/ (RUN: the folder holding the output) holds the settings and the five
    curves at step = samples done: the first batch's (the first point), and the run's totals at the
    last step, the shard's sample count."""
    prepared, out = extracted[name]
    scalars = tensorboard_scalars(out.parent / TENSORBOARD_DIR / "extract")
    assert sorted(scalars) == sorted(SCALARS)
    lengths = dict(enumerate(Dataset.load_from_disk(str(prepared))["num_tokens"]))
    first_batch = len(plan_batches(lengths, BATCH_TOKENS)[0])
    for tag in SCALARS:
        steps = [step for step, _value in scalars[tag]]
        assert steps[0] == first_batch and steps[-1] == NUM_SAMPLES and steps == sorted(set(steps)), (tag, steps)
    final = {tag: scalars[tag][-1][1] for tag in SCALARS}
    files = list(out.rglob("data_*.pt"))
    assert final["extract/samples_written"] == NUM_SAMPLES and final["extract/samples_failed"] == 0
    assert final["extract/bytes_written"] == sum(p.stat().st_size for p in files)
    assert final["extract/tokens_per_s"] > 0 and 0 < final["extract/forward_share"] <= 1
    events = EventAccumulator(str(out.parent / TENSORBOARD_DIR / "extract"))
    events.Reload()
    table = events.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    for row in ("| layer_ids | [2, 4, 5] |", f"| batch_tokens | {BATCH_TOKENS} |", "| storage | bf16 |",
                "| engine | hf |", f"| prepared_fingerprint | {DataConfig.load(out).prepared_fingerprint} |"):
        assert row in table, row


# --- at scale: resume, shards, failures, disk --------------------------------------------------


@pytest.mark.slow
def test_resume_after_sigkill_gives_the_uninterrupted_files(extracted, kimi_target, tmp_path):
    prepared, reference = extracted["kimi"]
    out = tmp_path / "hs"
    cmd = [sys.executable, str(REPO_ROOT / SCRIPT), *extract_args(prepared, kimi_target, out)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **ONE_THREAD})
    try:
        while not list(out.rglob("data_*.pt")):  # kill as soon as the first files are there
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    kept = list_sample_files(out)
    assert 0 < len(kept) < NUM_SAMPLES and not (out / DATA_CONFIG).exists()
    truncated = sample_path(out, min(kept))
    truncated.write_bytes(truncated.read_bytes()[:100])  # an unreadable file under a final name

    result = run_script(SCRIPT, *extract_args(prepared, kimi_target, out), env=ONE_THREAD)
    assert f"{len(kept) - 1:,} done, 1 to redo" in result.stdout
    assert_same_files(out, reference)
    assert not [p for p in out.rglob(".tmp-*")]
    assert (out / SAMPLE_LENGTHS).read_text() == (reference / SAMPLE_LENGTHS).read_text()
    # The resumed run's curves count on from the files it found (a new event file in the same folder,
    # what the killed run logged past them purged): steps never go back, the last is the sample count.
    folder = tmp_path / TENSORBOARD_DIR / "extract"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2
    written = tensorboard_scalars(folder)["extract/samples_written"]
    steps = [step for step, _value in written]
    assert steps == sorted(set(steps)) and written[-1] == (NUM_SAMPLES, NUM_SAMPLES - (len(kept) - 1))


def test_rows_of_an_earlier_prepared_dataset_are_removed(flat_target, tmp_path, capsys):
    """01 run again with fewer rows into the same run folder: 02 keeps no file past the new end,
    and the merged lists name only the new rows."""
    prepared, out = tmp_path / "prepared", tmp_path / "hs"
    write_prepared(prepared, flat_target, 10, seed=1)
    load_script().main(extract_args(prepared, flat_target, out, "--report-to", "none"))
    first = DataConfig.load(out).prepared_fingerprint
    assert len(list_sample_files(out)) == 10 and first
    shutil.rmtree(prepared)
    write_prepared(prepared, flat_target, 6, seed=2)
    load_script().main(extract_args(prepared, flat_target, out, "--report-to", "none"))
    assert not (tmp_path / TENSORBOARD_DIR).exists() and not (tmp_path / "wandb").exists()  # --report-to none
    assert "removed 4 files of rows past its end" in capsys.readouterr().out
    assert sorted(list_sample_files(out)) == list(range(6))
    assert sorted(json.loads((out / SAMPLE_LENGTHS).read_text())) == [str(i) for i in range(6)]
    assert DataConfig.load(out).prepared_fingerprint not in ("", first)


@pytest.mark.slow
def test_two_shards_give_the_single_process_files(extracted, kimi_target, tmp_path):
    """... and report as two tracker runs: TensorBoard folders and offline W&B runs of their own."""
    prepared, reference = extracted["kimi"]
    out = tmp_path / "hs"
    base = [sys.executable, str(REPO_ROOT / SCRIPT), *extract_args(prepared, kimi_target, out),
            "--report-to", "tensorboard", "wandb"]
    env = {**os.environ, **ONE_THREAD, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    procs = [subprocess.Popen(base + ["--num-shards", "2", "--shard-index", "0"], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env),
             # the second shard takes its place from torchrun's variables
             subprocess.Popen(base, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": "1", "WORLD_SIZE": "2"})]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    shards = [json.loads((out / f"extract_shard_{j}_of_2.json").read_text())["lengths"] for j in range(2)]
    assert shards[0] and shards[1] and not set(shards[0]) & set(shards[1])
    assert_same_files(out, reference)
    assert (out / SAMPLE_LENGTHS).read_text() == (reference / SAMPLE_LENGTHS).read_text()
    assert json.loads((out / DATA_CONFIG).read_text())["num_shards"] == 2
    for j, lengths in enumerate(shards):
        scalars = tensorboard_scalars(tmp_path / TENSORBOARD_DIR / f"extract-shard-{j}-of-2")
        assert scalars["extract/samples_written"][-1] == (len(lengths), len(lengths))
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))  # RUN/wandb/, one run per shard, named for it
    assert len(runs) == 2 and all(list(run.glob("run-*.wandb")) for run in runs)
    logged = b"".join(next(run.glob("run-*.wandb")).read_bytes() for run in runs)
    for j in range(2):
        assert f"{tmp_path.name}-extract-shard-{j}-of-2".encode() in logged
    assert b"extract/tokens_per_s" in logged


def test_batch_out_of_memory_is_split_and_a_sample_out_of_memory_alone_skipped(kimi_target, tmp_path, monkeypatch):
    prepared = write_prepared(tmp_path / "prepared", kimi_target, 8)
    poison = Dataset.load_from_disk(str(prepared))[3]["input_ids"]
    calls = []
    forward = StateExtractor.__call__

    def flaky(self, id_lists):
        calls.append(len(id_lists))
        if len(id_lists) > 1 or poison in id_lists:  # batches "run out of memory", so does sample 3
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(self, id_lists)

    monkeypatch.setattr(StateExtractor, "__call__", flaky)
    out = tmp_path / "hs"
    load_script().main(extract_args(prepared, kimi_target, out))
    assert sorted(list_sample_files(out)) == [0, 1, 2, 4, 5, 6, 7]
    assert calls.count(1) == 8 and max(calls) > 1
    config = json.loads((out / DATA_CONFIG).read_text())
    assert [(f["index"], f["sample_id"]) for f in config["failed"]] == [(3, "rand-3")]
    assert "out of memory" in config["failed"][0]["error"] and config["sample_count"] == 7


def test_an_error_other_than_out_of_memory_stops_the_run(kimi_target, tmp_path, monkeypatch):
    prepared = write_prepared(tmp_path / "prepared", kimi_target, 6)
    calls = []

    def broken(self, id_lists):
        calls.append(len(id_lists))
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (simulated bug)")

    monkeypatch.setattr(StateExtractor, "__call__", broken)
    with pytest.raises(PipelineError, match=r"extraction failed on samples rand-\d.*shapes cannot be multiplied "
                                            r"\(simulated bug\) \(only out-of-memory errors are retried\)"):
        load_script().main(extract_args(prepared, kimi_target, tmp_path / "hs"))
    assert len(calls) == 1  # no retry of a bug, no second forward pass per sample


def test_systematic_out_of_memory_stops_past_the_skip_limit(kimi_target, tmp_path, monkeypatch):
    from common.errors import MIN_SKIPPED_LIMIT

    prepared = write_prepared(tmp_path / "prepared", kimi_target, MIN_SKIPPED_LIMIT + 4)
    monkeypatch.setattr(StateExtractor, "__call__", lambda self, ids: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory (simulated)")))
    with pytest.raises(PipelineError, match=rf"^{MIN_SKIPPED_LIMIT + 1} samples skipped .*limit {MIN_SKIPPED_LIMIT} "
                                            r"in all.*out of memory"):
        load_script().main(extract_args(prepared, kimi_target, tmp_path / "hs"))


def test_disk_check_refuses_a_small_disk(kimi_target, tmp_path, monkeypatch):
    prepared = write_prepared(tmp_path / "prepared", kimi_target, 5)
    monkeypatch.setattr("common.hidden_states.folder_lock.shutil.disk_usage", lambda _p: shutil._ntuple_diskusage(10**6, 10**6, 1000))
    args = extract_args(prepared, kimi_target, tmp_path / "hs", "--max-samples", "3")
    with pytest.raises(PipelineError, match=r"has 1\.0 KB free, the samples still to extract need about [\d.,]+ KB; "
                                            ".*--skip-disk-check"):  # the units of the sizes, not "0.0 GB"
        load_script().main(args)
    assert not list((tmp_path / "hs").rglob("data_*.pt"))
    load_script().main(args + ["--skip-disk-check"])
    assert sorted(list_sample_files(tmp_path / "hs")) == [0, 1, 2]


def test_disk_check_counts_fp8_as_half(kimi_target, tmp_path, monkeypatch):
    """A disk between the fp8 and the bf16 estimate takes an fp8 run and refuses a bf16 one."""
    prepared = write_prepared(tmp_path / "prepared", kimi_target, 5)
    tokens = sum(len(r) for r in Dataset.load_from_disk(str(prepared))[:3]["input_ids"])
    fp8, bf16 = (estimate_bytes(tokens, 3, 64, STORAGES[name]) for name in ("fp8", "bf16"))
    free = (fp8 + bf16) // 2
    monkeypatch.setattr("common.hidden_states.folder_lock.shutil.disk_usage", lambda _p: shutil._ntuple_diskusage(free, free, free))
    with pytest.raises(PipelineError, match="need about"):
        load_script().main(extract_args(prepared, kimi_target, tmp_path / "bf16", "--max-samples", "3"))
    load_script().main(extract_args(prepared, kimi_target, tmp_path / "fp8", "--max-samples", "3", "--storage", "fp8"))
    assert sorted(list_sample_files(tmp_path / "fp8")) == [0, 1, 2]


# --- fp8 storage -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def extracted_fp8(extracted, kimi_target, tmp_path_factory) -> Path:
    """The Kimi-style run of `extracted` again, stored as fp8."""
    prepared, _bf16 = extracted["kimi"]
    out = tmp_path_factory.mktemp("extract-fp8") / "hs"
    run_in_process(SCRIPT, *extract_args(prepared, kimi_target, out, "--storage", "fp8"), check=True)
    return out


def test_fp8_files_are_the_bf16_runs_states_in_half_the_bytes(extracted, extracted_fp8):
    prepared, bf16_out = extracted["kimi"]
    bf16, fp8 = read_files(bf16_out), read_files(extracted_fp8)
    assert sorted(fp8) == sorted(bf16) == list(range(NUM_SAMPLES))
    assert [p.name for p in extracted_fp8.rglob("*pt")] and all(p.name.startswith("data_")
                                                               for p in extracted_fp8.rglob("*pt"))
    fp8_bytes = bf16_bytes = 0
    for i, data in fp8.items():
        size = len(data["input_ids"])
        assert set(data) == {"input_ids", "hidden_states", "loss_mask", SCALES_KEY}
        assert torch.equal(data["input_ids"], bf16[i]["input_ids"]) and torch.equal(data["loss_mask"],
                                                                                     bf16[i]["loss_mask"])
        states, scales = data["hidden_states"], data[SCALES_KEY]
        assert [(s.dtype, s.shape) for s in states] == [(torch.float8_e4m3fn, (size, 64))] * 4
        assert scales.dtype == torch.bfloat16 and scales.shape == (4, size)
        fp8_bytes += sum(s.untyped_storage().nbytes() for s in states) + scales.untyped_storage().nbytes()
        bf16_bytes += sum(s.untyped_storage().nbytes() for s in bf16[i]["hidden_states"])
        for back, ref in zip(STORAGES["fp8"].decode(data), bf16[i]["hidden_states"], strict=True):
            ref = ref.float()
            assert float((back - ref).norm() / ref.norm()) < 0.04, i
    assert fp8_bytes == sum(len(d["input_ids"]) for d in fp8.values()) * 4 * (64 + 2)
    assert fp8_bytes / bf16_bytes <= 0.53
    config = json.loads((extracted_fp8 / DATA_CONFIG).read_text())
    assert config["storage"] == "fp8" and config["dtype"] == "float8_e4m3fn" and SCALES_KEY in config["scales"]
    assert (extracted_fp8 / SAMPLE_LENGTHS).read_text() == (bf16_out / SAMPLE_LENGTHS).read_text()


def test_fp8_run_resumes_on_its_own_files(extracted, kimi_target, extracted_fp8, tmp_path):
    prepared, _ = extracted["kimi"]
    out = tmp_path / "hs"
    shutil.copytree(extracted_fp8, out)
    broken = sample_path(out, 5)
    broken.write_bytes(broken.read_bytes()[:100])
    load_script().main(extract_args(prepared, kimi_target, out, "--storage", "fp8"))
    assert_same_files(out, extracted_fp8)
    assert torch.equal(torch.load(broken, weights_only=True)[SCALES_KEY],
                       torch.load(sample_path(extracted_fp8, 5), weights_only=True)[SCALES_KEY])


# --- bad input: exit 1 with a clear message, nothing written lost ------------------------------


def test_bad_input_is_refused(extracted, kimi_target, flat_target, tmp_path):
    prepared, _reference = extracted["kimi"]
    main = load_script().main
    with pytest.raises(PipelineError, match="no such folder"):
        main(extract_args(prepared, tmp_path / "missing", tmp_path / "a"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(PipelineError, match="cannot read config.json"):
        main(extract_args(prepared, broken, tmp_path / "a"))
    with pytest.raises(PipelineError, match=r"--layer-ids 2 4 9: \[9\] out of range.*1\.\.7"):
        main(extract_args(prepared, kimi_target, tmp_path / "a", "--layer-ids", "2", "4", "9"))
    kimi_prepared = write_prepared(tmp_path / "kimi-prepared", kimi_target, 3, kimi_row=1)
    with pytest.raises(PipelineError, match=rf"sample rand-1 \(row 1\) holds token id {KIMI_IM_END}, outside the "
                                            r"target's vocabulary 0\.\.4095"):
        main(extract_args(kimi_prepared, flat_target, tmp_path / "a"))
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("change", ["target", "layer_ids", "storage", "foreign_pt"])
def test_output_of_another_target_is_left_untouched(extracted, kimi_target, flat_target, tmp_path, change):
    prepared, reference = extracted["kimi"]
    out = tmp_path / "hs"
    shutil.copytree(reference, out)
    args = {"target": extract_args(prepared, flat_target, out),
            "layer_ids": extract_args(prepared, kimi_target, out, "--layer-ids", "1", "2", "3"),
            "storage": extract_args(prepared, kimi_target, out, "--storage", "fp8"),
            "foreign_pt": extract_args(prepared, kimi_target, out)}[change]
    if change == "foreign_pt":
        torch.save({}, out / "t2d.pt")
    before = folder_digest(out)
    match = {"target": "architecture KimiK25ForConditionalGeneration in data_config.json, LlamaForCausalLM now",
             "layer_ids": r"layer_ids \[2, 4, 5\] in data_config.json, \[1, 2, 3\] now",
             "storage": "storage bf16 in data_config.json, fp8 now",
             "foreign_pt": "t2d.pt, which is not a hidden-state file"}[change]
    with pytest.raises(PipelineError, match=match):
        load_script().main(args)
    assert folder_digest(out) == before


def test_script_exits_1_with_one_line(tmp_path, kimi_target):
    result = run_in_process(SCRIPT, "--prepared", tmp_path / "nothing", "--target", kimi_target, "--trust-remote-code",
                            "--output", tmp_path / "hs")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: prepared dataset")
