"""`--engine vllm` at both ends, with vLLM's CPU build from .venv-vllm (scripts/setup_vllm_env.sh).

On the flat miniature: 02's vLLM files equal the HF engine's within bf16 tolerance, and resume
keeps them; 05 serves two trained drafts, vLLM's output is the same with and without
speculation at temperature 0, and its acceptance counts equal 05's own (both in bf16). Bad
input (no or an old vLLM, a layer id out of range, a draft vLLM refuses) ends with one line.

Every engine start costs about a minute on 2 CPU cores: the module starts five (02 once, 05's
two drafts and its plain run, the refused draft). Without the environment the tests are skipped,
unless REQUIRE_VLLM=1 (set by .ci/run), which makes its absence a failure.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from conftest import run_script

from common.hidden_states.vllm_states import rms_norm
from common.vllm.client import _log_cause

pytestmark = [pytest.mark.vllm]
K = 3
ENV = {"OMP_NUM_THREADS": "1"}  # much faster than 2 threads on a shared 2-core machine
# 05's decoder and vLLM both run the target and the draft in bf16 but with different kernels:
# a near-tie between the draft's two best tokens may break differently in one of them and change
# that pass's acceptance, while the target's output stays the same (checked token for token).
# The draft here is trained on 12 samples, so its top logits are often that close: on the trained
# (non-looping) flat miniature, 6 prompts of 32 tokens, the two differed by 5.6% (1.216 vs 1.148).
# 8% allows that and still catches a counting convention that differs (one pass per prompt more
# or less is ~4%, plus the near-ties). On looping targets both gave identical counts.
AL_TOLERANCE = 0.08


@pytest.fixture(scope="module")
def flat_run(tmp_path_factory, flat_target, demo_conversations, vllm_python) -> Path:
    """01 -> 04 on the flat miniature with the HF engine: prepared data, HF states, a draft
    trained 10 epochs (RUN/draft) and one trained 1 epoch (RUN/weak/draft)."""
    run = tmp_path_factory.mktemp("vllm_run")
    common = ["--run-dir", run, "--target", flat_target]
    run_script("01_prepare_data.py", *common, "--input", demo_conversations, "--max-samples", "12", env=ENV)
    run_script("02_extract_hidden_states.py", *common, env=ENV)
    run_script("03_build_vocab_map.py", *common, "--draft-vocab-size", "1024", env=ENV)
    train = [*common, "--draft-config", "configs/draft_tiny.json", "--lr", "0.01"]
    run_script("04_train.py", *train, "--epochs", "10", env=ENV)
    run_script("04_train.py", *train, "--epochs", "1", "--output", run / "weak", env=ENV)
    return run


def load_states(folder: Path) -> dict[str, dict]:
    return {p.name: torch.load(p, weights_only=True) for p in sorted(folder.rglob("data_*.pt"))}


@pytest.mark.slow
def test_vllm_states_equal_hf_states(flat_run, flat_target):
    out = flat_run / "hidden_states_vllm"
    proc = run_script("02_extract_hidden_states.py", "--run-dir", flat_run, "--target", flat_target,
                      "--output", out, "--engine", "vllm", env=ENV)
    assert "compute bfloat16 on vLLM" in proc.stdout
    hf, vllm = load_states(flat_run / "hidden_states"), load_states(out)
    assert hf.keys() == vllm.keys() and len(hf) == 12
    for name, ours in vllm.items():
        theirs = hf[name]
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["loss_mask"], theirs["loss_mask"])
        for a, b in zip(ours["hidden_states"], theirs["hidden_states"], strict=True):
            assert a.dtype == torch.bfloat16 and a.shape == b.shape
            # HF computes in fp32 here, vLLM in bf16 through 8 layers: a few bf16 steps (2^-8) of the
            # largest value. A pre-norm final state (the norm forgotten) is off by far more.
            assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) < 0.02, name
    for key in ("layer_ids", "num_layers", "last_state", "sample_count", "token_count"):
        assert json.loads((out / "data_config.json").read_text())[key] == \
            json.loads((flat_run / "hidden_states" / "data_config.json").read_text())[key]
    assert json.loads((out / "sample_lengths.json").read_text()) == \
        json.loads((flat_run / "hidden_states" / "sample_lengths.json").read_text())
    assert not list(out.glob(".vllm-states-*")), "the engine's scratch folder is left behind"
    # Resume: a second run keeps every file and starts no engine.
    again = run_script("02_extract_hidden_states.py", "--run-dir", flat_run, "--target", flat_target,
                       "--output", out, "--engine", "vllm", "--vllm-python", "/nonexistent/python", check=False,
                       env=ENV)
    assert again.returncode == 1 and "vLLM not found" in again.stderr  # the environment is checked first
    again = run_script("02_extract_hidden_states.py", "--run-dir", flat_run, "--target", flat_target,
                       "--output", out, "--engine", "vllm", env=ENV)
    assert "kept 12 existing, extracted 0" in again.stdout and "started in" not in again.stdout


@pytest.mark.slow
def test_served_acceptance_equals_05s_own(flat_run, flat_target, tmp_path):
    report = tmp_path / "eval.json"
    proc = run_script("05_evaluate.py", "--run-dir", flat_run, "--target", flat_target, "--reference",
                      flat_run / "weak" / "draft", "--engine", "vllm", "--dtype", "bf16", "--max-prompts", "6",
                      "--max-new-tokens", "32", "--num-speculative-tokens", str(K), "--json", report, env=ENV)
    assert "draft (vLLM)" in proc.stdout and "reference (vLLM)" in proc.stdout
    data = json.loads(report.read_text())
    assert data["engine"] == "vllm"
    for draft in data["drafts"]:
        served = draft["vllm"]
        assert served["num_drafts"] > 0 and len(served["acceptance_rate_per_position"]) == K
        assert served["identical_to_greedy"], f"{draft['name']}: vLLM output changed with speculation"
        assert served["measured_acceptance_length"] == pytest.approx(
            1 + served["num_accepted_tokens"] / served["num_drafts"])
        assert abs(served["measured_acceptance_length"] - draft["measured_acceptance_length"]) \
            <= AL_TOLERANCE * draft["measured_acceptance_length"], draft["name"]
        # Same prompts, same greedy target: vLLM's outputs are 05's outputs, but for a bf16 near-tie
        # that breaks the other way in vLLM's kernels (then the texts, and what the draft is scored
        # on, differ from there on: seen on one prompt of six on the trained flat miniature).
        own = [g["tokens"] for g in draft["generations"]]
        same = sum(a == b for a, b in zip(served["outputs"], own, strict=True))
        assert same >= len(own) - 2, f"{draft['name']}: only {same} of {len(own)} generations equal 05's"


@pytest.mark.slow
def test_draft_vllm_refuses_is_one_line(flat_run, flat_target, tmp_path):
    """A draft whose attention head size (64 / 4 = 16) vLLM's CPU kernels do not support."""
    draft = tmp_path / "draft16"
    draft.mkdir()
    for f in (flat_run / "draft").iterdir():
        (draft / f.name).write_bytes(f.read_bytes())
    config = json.loads((draft / "config.json").read_text())
    layer = config["transformer_layer_config"]
    layer.update(num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    (draft / "config.json").write_text(json.dumps(config))
    proc = run_script("05_evaluate.py", "--run-dir", flat_run, "--target", flat_target, "--draft", draft,
                      "--engine", "vllm", "--max-prompts", "1", "--max-new-tokens", "4", check=False, env=ENV)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: vLLM serving") and str(draft) in last and "log: " in last, proc.stderr
    assert Path(last.rsplit("log: ", 1)[1]).is_file()  # kept for the details


def fake_python(folder: Path, version: str) -> Path:
    """An executable that answers the version probe like a python with that vLLM."""
    path = folder / "python"
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.parametrize("python, message", [
    ("missing", "vLLM not found: no --vllm-python"),
    ("0.10.1", "is too old: 0.32 or later needed"),
])
def test_unusable_vllm_is_refused_before_any_output(flat_target, tmp_path, python, message):
    vllm = tmp_path / "nothing" / "python" if python == "missing" else fake_python(tmp_path, python)
    run = tmp_path / "run"
    run_script("01_prepare_data.py", "--run-dir", run, "--target", flat_target, "--max-samples", "2", env=ENV)
    proc = run_script("02_extract_hidden_states.py", "--run-dir", run, "--target", flat_target, "--engine", "vllm",
                      "--vllm-python", vllm, check=False, env=ENV)
    assert proc.returncode == 1 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (run / "hidden_states").exists()


def test_layer_id_out_of_range_is_refused_before_the_engine(flat_target, tmp_path):
    run = tmp_path / "run"
    run_script("01_prepare_data.py", "--run-dir", run, "--target", flat_target, "--max-samples", "2", env=ENV)
    proc = run_script("02_extract_hidden_states.py", "--run-dir", run, "--target", flat_target, "--engine", "vllm",
                      "--vllm-python", fake_python(tmp_path, "0.32.0"), "--layer-ids", "2", "4", "8",
                      check=False, env=ENV)
    assert proc.returncode == 1 and "[8] out of range" in proc.stderr
    assert not (run / "hidden_states").exists()


def test_final_norm_matches_the_target(flat_target):
    """rms_norm with the checkpoint's weight reproduces the HF model's own final norm."""
    from common.hidden_states.vllm_states import final_norm_of
    from common.target.config import load_target_info
    from common.target.model import load_text_model

    info = load_target_info(flat_target, trust_remote_code=True)
    model = load_text_model(info)
    x = torch.randn(5, info.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    weight, eps = final_norm_of(info)
    assert torch.allclose(rms_norm(x, weight, eps), model.model.norm(x), atol=1e-5)


def test_log_cause_skips_vllm_wrappers(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO start\n(EngineCore pid=1) ValueError: head size 16 is not supported\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert _log_cause(log) == "ValueError: head size 16 is not supported"
