"""Step 05 end to end: the script's report (measured and offline figures, baselines, sampling), on
04's held-out rows and on prompt sets in their published formats (MT-Bench's two turns, HumanEval,
per category and per k, thinking and instant mode), the same figures in the experiment trackers,
and its bad-input errors. The unit tests of common/evaluate/ are in tests/common/evaluate/."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import export_untrained, run_in_process
from helpers import run_script as run_any_script
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.draft.model import TINY_CONFIG
from common.evaluate.prompts import select_prompts
from common.prepare.prepared_dataset import load_prepared
from common.target.config import load_target_info
from common.target.model import load_text_model
from common.trackers import TENSORBOARD_DIR

SCRIPT = "05_evaluate.py"
K = 3
SAMPLES = 100  # prepared samples of the script tests' run
NEW_TOKENS = 32  # answer tokens the target writes per sample, and tokens decoded per prompt
# Small files in the published formats (the real sets are fetched, never by the tests).
MT_BENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it sad."]},
            {"question_id": 101, "category": "reasoning", "turns": ["Which is heavier, a kilo of iron or of wool?",
                                                                    "Why do people get it wrong?"]},
            {"question_id": 102, "category": "reasoning", "turns": ["What comes after Tuesday?", "And before?"]}]
HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a: int, b: int) -> int:\n    \"\"\"Sum of a and b.\"\"\"\n",
              "entry_point": "add", "canonical_solution": "    return a + b\n", "test": ""}]


def run_script(script: str, *args, **kwargs):
    """A numbered script as a subprocess with one intra-op thread (the miniatures gain nothing
    from more, and on a shared 2-core machine threads spin against other processes)."""
    return run_any_script(script, *args, env={"OMP_NUM_THREADS": "1"}, **kwargs)


def tensorboard_events(path: Path) -> EventAccumulator:
    """The events of an event file, or of a folder's as TensorBoard reads them."""
    events = EventAccumulator(str(path))
    events.Reload()
    return events


def tensorboard_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of `tensorboard_events(path)`."""
    events = tensorboard_events(path)
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory) -> tuple[Path, Path]:
    """MT-Bench's question.jsonl and HumanEval's .jsonl.gz, three and one items."""
    folder = tmp_path_factory.mktemp("prompt_sets")
    mt, he = folder / "question.jsonl", folder / "HumanEval.jsonl.gz"
    mt.write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    he.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in HUMANEVAL).encode()))
    return mt, he


# --- the script ----------------------------------------------------------------------------------


def self_distill(source: Path, target: Path, out: Path, max_new_tokens: int) -> None:
    """A prepared dataset whose answers are the target's own greedy continuations of the
    prompts of `source` (supervised), as EAGLE training data is regenerated with the target.
    The miniature target's weights are random, so its continuations look nothing like the demo
    answers; a draft trained on those would learn nothing that transfers to decoding."""
    ds, report = load_prepared(source)
    info = load_target_info(target, trust_remote_code=True)
    model = load_text_model(info)
    stop_ids = info.stop_ids
    prompts, _ = select_prompts(ds, len(ds))
    rows = {"sample_id": [], "input_ids": [], "loss_mask": [], "num_tokens": []}
    for start in range(0, len(prompts), 32):  # batched (left-padded) greedy decoding: fast enough
        batch = prompts[start:start + 32]
        longest = max(len(p.ids) for p in batch)
        ids = torch.tensor([[0] * (longest - len(p.ids)) + p.ids for p in batch])
        mask = torch.tensor([[0] * (longest - len(p.ids)) + [1] * len(p.ids) for p in batch])
        new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=sorted(stop_ids), pad_token_id=0)[:, longest:].tolist()
        for prompt, answer in zip(batch, new):
            ends = [i for i, t in enumerate(answer) if t in stop_ids]
            answer = answer[:ends[0] + 1] if ends else answer
            rows["sample_id"].append(prompt.sample_id)
            rows["input_ids"].append(prompt.ids + answer)
            rows["loss_mask"].append([0] * len(prompt.ids) + [1] * len(answer))
            rows["num_tokens"].append(len(prompt.ids) + len(answer))
    Dataset.from_dict(rows).save_to_disk(str(out))
    report.save(out)


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, kimi_target, demo_conversations) -> Path:
    """A run folder on the Kimi-style target: 01 on demo conversations, their answers replaced
    by the target's own continuations, 02, 03, and an untrained draft (RUN/untrained)."""
    run = tmp_path_factory.mktemp("run05")
    common = ["--run-dir", run, "--target", kimi_target, "--trust-remote-code"]
    run_in_process("01_prepare_data.py", *common, "--input", demo_conversations, "--max-samples", str(SAMPLES),
                   "--max-len", "256", "--output", run / "conversations", check=True)
    self_distill(run / "conversations", kimi_target, run / "prepared", NEW_TOKENS)
    run_in_process("02_extract_hidden_states.py", *common, check=True)
    run_in_process("03_build_vocab_map.py", *common, "--draft-vocab-size", "1024", check=True)
    export_untrained(kimi_target, run / "untrained")
    return run


def test_script_reports_measured_and_offline_figures(eval_run, kimi_target, tmp_path):
    reference = export_untrained(kimi_target, tmp_path / "reference", seed=1)
    out = tmp_path / "eval.json"
    board = eval_run / TENSORBOARD_DIR / "evaluate"
    earlier = set(board.glob("events.out.tfevents.*"))
    proc = run_script(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                      "--draft", eval_run / "untrained", "--reference", reference, "--max-prompts", "2",
                      "--max-new-tokens", "12", "--max-samples", "3", "--json", out)
    report = json.loads(out.read_text())
    # TensorBoard by default, into RUN_DIR/tensorboard/evaluate/: each draft's figures at step = k
    (events,) = set(board.glob("events.out.tfevents.*")) - earlier
    scalars = tensorboard_scalars(events)
    for tag, figure in (("evaluate/all", report["drafts"][0]["measured_acceptance_length"]),
                        ("evaluate/all/reference", report["drafts"][1]["measured_acceptance_length"]),
                        ("evaluate/held-out", report["drafts"][0]["measured_acceptance_length"]),
                        ("evaluate/offline", report["drafts"][0]["simulated_acceptance_length"]),
                        ("evaluate/all/ngram", report["baselines"]["ngram"]["measured_acceptance_length"])):
        name = "simulated_acceptance_length" if tag.endswith("offline") else "acceptance_length"
        assert scalars[f"{tag}/{name}"] == [(K, pytest.approx(figure, rel=1e-6, abs=1e-6))], tag
    for key in ("measured_acceptance_length", "simulated_acceptance_length", "acceptance_rate_per_position",
                "identical_to_greedy"):
        assert key in report
    assert report["identical_to_greedy"] is True
    assert [d["name"] for d in report["drafts"]] == ["draft", "reference"]
    for draft in report["drafts"]:
        assert draft["identical_to_greedy"] is True
        assert 1.0 <= draft["measured_acceptance_length"] <= 1 + K
        assert len(draft["acceptance_rate_per_position"]) == K
        assert len(draft["offline"]["cond_acc"]) == K and draft["offline"]["samples"] == 3
        assert len(draft["generations"]) == 2 and all(g["text"] for g in draft["generations"])
        assert draft["tokens_generated"] == sum(len(g["tokens"]) for g in draft["generations"])
    assert "measured acceptance length" in proc.stdout and "simulated acceptance length" in proc.stdout
    header = ["draft", "reference", "n-gram", "untrained", "no", "speculation"]
    assert any(line.split() == header for line in proc.stdout.splitlines())  # the table header
    assert "no training split known" in proc.stdout  # an untrained draft has no 04 record beside it
    assert report["temperature"] == 0.0
    assert 0.0 <= report["degenerate_share"] <= 1.0 and 0.0 < report["distinct_ratio"] <= 1.0
    for name in ("ngram", "untrained", "none"):
        baseline = report["baselines"][name]
        assert 1.0 <= baseline["measured_acceptance_length"] <= 1 + K and baseline["identical_to_greedy"] is True
    assert report["baselines"]["none"]["measured_acceptance_length"] == 1.0


def test_script_samples_at_a_temperature(eval_run, kimi_target, tmp_path):
    """--temperature/--top-p: speculative sampling (equal to the target's distribution, see
    tests/common/evaluate/test_decoding.py), so outputs are not compared token by token with
    greedy decoding."""
    out = tmp_path / "eval.json"
    board = eval_run / TENSORBOARD_DIR / "evaluate"
    earlier = sorted(board.glob("*"))
    run_script(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
               "--draft", eval_run / "untrained", "--max-prompts", "2", "--max-new-tokens", "12",
               "--temperature", "1.0", "--top-p", "0.9", "--json", out, "--report-to", "none")
    report = json.loads(out.read_text())
    assert sorted(board.glob("*")) == earlier and not (eval_run / "wandb").exists()  # --report-to none
    assert report["temperature"] == 1.0 and report["top_p"] == 0.9 and report["draft_sampling"] == "greedy"
    assert report["identical_to_greedy"] is None
    assert 1.0 <= report["measured_acceptance_length"] <= 1 + K
    assert 1.0 <= report["baselines"]["ngram"]["measured_acceptance_length"] <= 1 + K
    proc = run_in_process(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                          "--draft", eval_run / "untrained", "--top-p", "0.5")
    assert proc.returncode == 1 and "--top-p 0.5 needs --temperature > 0" in proc.stderr
    proc = run_in_process(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                          "--draft-sampling", "probabilistic")
    assert proc.returncode == 1 and "--draft-sampling probabilistic needs --temperature > 0" in proc.stderr


def test_script_measures_prompt_sets_per_category_and_k(eval_run, kimi_target, prompt_files, tmp_path):
    """MT-Bench's two turns and HumanEval in instant mode, greedy, at k = 2 and 3: per set and per
    category figures in the table, the JSON and TensorBoard (RUN_DIR/tensorboard/evaluate/, each
    against k), each k lossless, the existing keys at the first k."""
    mt, he = prompt_files
    out = tmp_path / "eval.json"
    run = tmp_path / "run"  # a run folder of its own: 04's draft and 02's states named by their flags
    proc = run_script(SCRIPT, "--run-dir", run, "--target", kimi_target, "--trust-remote-code",
                      "--draft", eval_run / "untrained", "--data", eval_run / "hidden_states", "--prompts", mt,
                      "--prompts", he, "--thinking", "off", "--temperature", "0", "--num-speculative-tokens", "2",
                      "3", "--max-new-tokens", "8", "--json", out, "--report-to", "tensorboard")
    report = json.loads(out.read_text())
    assert report["thinking"] == "off" and report["temperature"] == 0.0
    assert report["prompt_sets"] == ["question", "HumanEval"] and report["prompts"] == 7  # 3 x 2 turns + 1
    assert set(report["by_k"]) == {"2", "3"} and report["num_speculative_tokens"] == 2
    assert report["measured_acceptance_length"] == report["by_k"]["2"]["drafts"][0]["measured_acceptance_length"]
    for k in ("2", "3"):
        entry = report["by_k"][k]
        for figures in [*entry["drafts"], entry["baselines"]["ngram"], entry["baselines"]["untrained"]]:
            assert figures["identical_to_greedy"] is True, (k, figures["name"])
            assert len(figures["acceptance_rate_per_position"]) == int(k)
            sets = figures["by_prompt_set"]
            assert sets["question"]["generations"] == 6 and sets["HumanEval"]["generations"] == 1
            assert {c: v["generations"] for c, v in sets["question"]["by_category"].items()} == \
                {"writing": 2, "reasoning": 4}
            assert sets["HumanEval"]["by_category"] == {}
            assert 1.0 <= sets["question"]["measured_acceptance_length"] <= 1 + int(k)
    turns = [(g["sample_id"], g["turn"]) for g in report["drafts"][0]["generations"]]
    assert turns[:2] == [("question:81:1", 1), ("question:81:2", 2)] and turns[-1] == ("HumanEval:HumanEval/0", 1)
    lines = proc.stdout.splitlines()
    assert any(line.split()[:4] == ["draft", "k=2", "draft", "k=3"] for line in lines)
    assert any(line.strip().startswith("reasoning (4)") for line in lines)
    assert "thinking off" in proc.stdout

    board = run / TENSORBOARD_DIR / "evaluate"
    scalars = tensorboard_scalars(board)
    for k in (2, 3):
        entry = report["by_k"][str(k)]
        draft, baselines = entry["drafts"][0], entry["baselines"]
        expected = {"evaluate/all/acceptance_length": draft["measured_acceptance_length"],
                    "evaluate/offline/simulated_acceptance_length": draft["simulated_acceptance_length"],
                    "evaluate/all/ngram/acceptance_length": baselines["ngram"]["measured_acceptance_length"]}
        for name in ("question", "HumanEval"):
            figures = draft["by_prompt_set"][name]
            expected[f"evaluate/{name}/acceptance_length"] = figures["measured_acceptance_length"]
            expected |= {f"evaluate/{name}/acceptance_rate/position_{j + 1}": rate
                         for j, rate in enumerate(figures["acceptance_rate_per_position"])}
            for baseline in ("ngram", "untrained"):
                expected[f"evaluate/{name}/{baseline}/acceptance_length"] = \
                    baselines[baseline]["by_prompt_set"][name]["measured_acceptance_length"]
        expected["evaluate/question/category/reasoning/acceptance_length"] = \
            draft["by_prompt_set"]["question"]["by_category"]["reasoning"]["measured_acceptance_length"]
        for tag, figure in expected.items():
            assert dict(scalars[tag])[k] == pytest.approx(figure, rel=1e-6, abs=1e-6), (tag, k)
    assert [step for step, _ in scalars["evaluate/question/acceptance_length"]] == [2, 3]
    assert [step for step, _ in scalars["evaluate/question/acceptance_rate/position_3"]] == [3]
    table = tensorboard_events(board).Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    for row in ("| temperature | 0.0 |", "| engine | hf |", "| max_new_tokens | 8 |",
                f"| drafts/draft | {eval_run / 'untrained'} |", '| prompt_sets | ["question", "HumanEval"] |'):
        assert row in table, row


def test_thinking_mode_sets_kimis_serving_temperature(eval_run, kimi_target, prompt_files, tmp_path):
    """... reporting to W&B alone (offline): a run folder under RUN_DIR/wandb/, no TensorBoard folder."""
    out = tmp_path / "eval.json"
    run_any_script(SCRIPT, "--run-dir", tmp_path, "--target", kimi_target, "--trust-remote-code",
                   "--draft", eval_run / "untrained", "--prompts", prompt_files[1], "--thinking", "on",
                   "--num-speculative-tokens", "1", "--max-new-tokens", "4", "--no-baselines", "--json", out,
                   "--report-to", "wandb",
                   env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    report = json.loads(out.read_text())
    assert report["thinking"] == "on" and report["temperature"] == 1.0 and report["identical_to_greedy"] is None
    (wandb_run,) = (tmp_path / "wandb").glob("offline-run-*")
    logged = next(wandb_run.glob("run-*.wandb")).read_bytes()
    assert f"{tmp_path.name}-evaluate".encode() in logged and b"evaluate/HumanEval/acceptance_length" in logged
    assert not (tmp_path / TENSORBOARD_DIR).exists()


@pytest.mark.parametrize("flags, message", [
    (["--prompts", "nowhere.jsonl"], "prompt set nowhere.jsonl: no such file"),
    (["--thinking", "on"], "--thinking on renders --prompts sets"),
    (["--num-speculative-tokens", "3", "3"], "a k is given twice"),
])
def test_prompt_flags_are_checked(eval_run, kimi_target, flags, message):
    proc = run_in_process(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                          "--draft", eval_run / "untrained", *flags)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("error: ") and message in last, proc.stderr


@pytest.mark.slow
def test_trained_draft_accepts_more_than_an_untrained_one(eval_run, kimi_target):
    """04 on the self-distilled run (exporting its best checkpoint), then 05 against the untrained
    draft and the n-gram baseline on 04's validation rows: the trained draft measures a higher
    acceptance length than both, below k + 1, close to its simulated one, on a target that
    writes text rather than loops."""
    common = ["--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code"]
    run_in_process("04_train.py", *common, "--draft-config", TINY_CONFIG, "--epochs", "10", "--lr", "0.01",
                   "--total-seq-len", "512", "--noise-std", "0", "--val-ratio", "0.2", check=True)
    out = eval_run / "eval.json"
    proc = run_script(SCRIPT, *common, "--reference", eval_run / "untrained", "--max-prompts", "20",
                      "--max-new-tokens", str(NEW_TOKENS), "--json", out)
    report = json.loads(out.read_text())
    trained, untrained = report["drafts"]
    print(proc.stdout)
    assert "04's validation rows" in proc.stdout
    split = json.loads((eval_run / "draft" / "validation_split.json").read_text())["validation_rows"]
    assert {g["row"] for g in trained["generations"]} <= set(split)
    train_report = json.loads((eval_run / "train_report.json").read_text())
    best = train_report["best_validation"]
    assert train_report["exported_checkpoint"].endswith(f"/{best['epoch']}")
    assert trained["identical_to_greedy"] and untrained["identical_to_greedy"]
    assert trained["degenerate_share"] <= 0.1 and trained["distinct_ratio"] >= 0.5  # the target writes text
    assert trained["measured_acceptance_length"] > untrained["measured_acceptance_length"] + 0.05
    assert trained["measured_acceptance_length"] > report["baselines"]["ngram"]["measured_acceptance_length"]
    assert trained["measured_acceptance_length"] < 1 + K
    assert untrained["measured_acceptance_length"] < 1.02
    # On the target's own continuations the measured figure is near the simulated one: a misaligned
    # proposer (states of the wrong position or layer) would measure about 1. The simulated figure is
    # the best of 10 epochs' passes over the same 20 rows, so it runs high: the measured one keeps at
    # least half of its tokens past the first (seen: 1.54 measured, 1.60 simulated, n-gram 1.11 on one
    # split; 1.62 and 1.82 on another).
    assert trained["measured_acceptance_length"] - 1 > (trained["simulated_acceptance_length"] - 1) / 2


def test_script_exits_1_with_one_line_on_a_bad_draft(eval_run, kimi_target):
    proc = run_in_process(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                          "--draft", kimi_target)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: draft ")
    assert "is not a speculators EAGLE-3 draft" in proc.stderr
