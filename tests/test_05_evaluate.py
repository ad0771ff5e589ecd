"""Step 05: greedy speculative decoding (lossless on both miniature targets, the draft run as it
was trained, the target's states captured at the right positions), acceptance statistics,
prompt selection, the offline metrics, the script's report and its bad-input errors."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_script as run_any_script
from datasets import Dataset
from safetensors.torch import save_file

from common.data.prepared_dataset import load_prepared
from common.draft import patch
from common.draft.model import TINY_CONFIG, build_draft, export_draft, read_config_file, speculator_config
from common.errors import PipelineError
from common.evaluate.decoding import (
    DraftProposer,
    Generation,
    Proposal,
    SamplingParams,
    SpeculativeStats,
    plain_generate,
    speculative_generate,
)
from common.evaluate.measure import DraftReport, MeasuredResult, check_draft, gap_notes, select_prompts, summary_table
from common.hidden_states.capture import capture_layers
from common.target.config import load_target_info
from common.target.int4_experts import PackedLinear
from common.target.model import decoder_parts, load_text_model
from common.train.metrics import simulated_acceptance_length
from common.vocab import build_maps

SCRIPT = "05_evaluate.py"
K = 3
DRAFT_VOCAB = 512
SAMPLES = 100  # prepared samples of the script tests' run
NEW_TOKENS = 32  # answer tokens the target writes per sample, and tokens decoded per prompt
GREEDY = SamplingParams()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The miniature models are too small to gain from intra-op threads, and on a shared 2-core
    machine two threads spinning against other processes make each forward pass ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_draft(target: Path, seed: int = 0):
    """An untrained draft for `target`, with a draft vocabulary that is not the identity map."""
    patch.apply(trust_remote_code=True, compile_forward=False)
    info = load_target_info(target, trust_remote_code=True)
    counts = torch.zeros(info.vocab_size, dtype=torch.long)
    counts[:4096] = torch.randint(1, 100, (4096,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_maps(counts, DRAFT_VOCAB)
    config = speculator_config(read_config_file(TINY_CONFIG).model, info, DRAFT_VOCAB, info.default_layer_ids(), K)
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
def models(kimi_target, flat_target):
    """(target model, info, random draft) per miniature target, loaded once."""
    loaded = {}
    for name, path in (("kimi", kimi_target), ("flat", flat_target)):
        info = load_target_info(path, trust_remote_code=True)
        loaded[name] = (load_text_model(info), info, random_draft(path))
    return loaded


def run_script(script: str, *args, **kwargs):
    """A numbered script as a subprocess with one intra-op thread (see `one_thread`)."""
    return run_any_script(script, *args, env={"OMP_NUM_THREADS": "1"}, **kwargs)


def some_prompts(info, count: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 4096) for _ in range(length)] for _ in range(count)]


# --- the draft runs at inference exactly as it was trained ------------------------------------


def test_draft_chain_equals_the_training_forward(models):
    """The proposer's chain after every prefix equals the library's training forward, whose TTT
    step j at position i is the draft's j+1-th proposal after token i+1 (same masks, positions,
    d2t mapping). The proposer extends its cache in two chunks to exercise it."""
    _, _, draft = models["kimi"]
    torch.manual_seed(1)
    seq, hidden = 20, draft.hidden_size
    ids = torch.randint(0, 4096, (seq,))
    aux = torch.randn(1, seq, 3 * hidden)
    with torch.no_grad():
        steps = draft(hidden_states=aux[:, :-1], input_ids=ids[1:].unsqueeze(0), ttt_steps=K)
    expected = torch.stack([s[0] + draft.d2t[s[0]] for s in steps], dim=-1)  # [seq-1, K] target ids
    proposer = DraftProposer(draft)
    for i in range(seq - 1):
        proposer.reset()
        cut = max(1, (i + 1) // 2)
        proposer.extend(ids[1:1 + cut], aux[:, :cut])
        proposer.propose(K, GREEDY)  # a chain that verification would drop
        if i + 1 > cut:
            proposer.extend(ids[1 + cut:i + 2], aux[:, cut:i + 1])
        assert proposer.propose(K, GREEDY).tokens == expected[i].tolist(), f"prefix of {i + 2} tokens"
    assert draft.layers[0].self_attn.config._attn_implementation == patch.ATTENTION_NAME  # restored


# --- lossless ----------------------------------------------------------------------------------


class OracleProposer:
    """Proposes the target's known greedy continuation with random corruptions, so every count
    of accepted drafts (0..k) occurs; records the auxiliary states it is given."""

    device = torch.device("cpu")

    def __init__(self, prompt: list[int], continuation: list[int], seed: int):
        self.sequence = prompt + continuation
        self.rng = random.Random(seed)
        self.reset()

    def start(self, prompt: list[int]) -> None:
        self.reset()

    def reset(self) -> None:
        self.position = 1  # next index of `sequence` the draft gets as verified context (x_0 never)
        self.aux: list[torch.Tensor] = []

    def extend(self, token_ids: torch.Tensor, aux: torch.Tensor) -> None:
        assert aux.shape[:2] == (1, token_ids.shape[0])
        assert token_ids.tolist() == self.sequence[self.position:self.position + token_ids.shape[0]]
        self.position += token_ids.shape[0]
        self.aux.append(aux)

    def propose(self, k: int, sampling: SamplingParams, generator=None) -> Proposal:
        truth = (self.sequence[self.position:] + [0] * k)[:k]
        return Proposal([t if self.rng.random() < 0.75 else (t + 1) % 4096 for t in truth])


@pytest.mark.parametrize("name", ["kimi", "flat"])
def test_speculative_decoding_is_lossless(models, name):
    """Same tokens as plain greedy decoding (and as transformers' generate) with a random draft
    and with an oracle draft that gets 0..k tokens accepted; the states handed to the draft are
    the target's own states at the verified positions."""
    model, info, draft = models[name]
    assert (name == "kimi") == any(isinstance(m, PackedLinear) for m in model.modules())  # INT4 experts, as Kimi-K2.5
    stop_ids = info.stop_ids
    layer_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
    _, layers = decoder_parts(model)
    accepted_counts = set()
    for seed, prompt in enumerate(some_prompts(info, 3)):
        greedy = plain_generate(model, prompt, 24, stop_ids)
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=sorted(stop_ids), pad_token_id=0)[0, len(prompt):].tolist()
        assert greedy.tokens == reference
        oracle = OracleProposer(prompt, greedy.tokens, seed)
        with capture_layers(layers, layer_ids) as captured:
            random_run = speculative_generate(model, captured, layer_ids, DraftProposer(draft), prompt, K, 24, stop_ids)
            oracle_run = speculative_generate(model, captured, layer_ids, oracle, prompt, K, 24, stop_ids)
        assert random_run.tokens == greedy.tokens
        assert oracle_run.tokens == greedy.tokens
        accepted_counts.update(oracle_run.accepted)
        # every pass emits accepted + 1 tokens; the last pass may be cut at max_new_tokens
        assert sum(a + 1 for a in oracle_run.accepted) + 1 >= len(greedy.tokens)
        assert oracle_run.target_passes < len(greedy.tokens)  # fewer passes than plain greedy decoding

        seen = torch.cat(oracle.aux, dim=1)[0]
        full = model(torch.tensor([prompt + greedy.tokens]), output_hidden_states=True).hidden_states
        expected = torch.cat([full[i][0] for i in layer_ids], dim=-1)[:seen.shape[0]]
        torch.testing.assert_close(seen, expected, atol=1e-4, rtol=1e-4)
    assert accepted_counts == set(range(K + 1))


def test_stops_at_end_of_turn(models):
    model, info, draft = models["kimi"]
    prompt = some_prompts(info, 1)[0]
    first = plain_generate(model, prompt, 8, set()).tokens
    stop = {first[4]}
    cut = plain_generate(model, prompt, 8, stop).tokens
    assert cut == first[:first.index(first[4]) + 1]
    layer_ids = list(draft.config.eagle_aux_hidden_state_layer_ids)
    with capture_layers(decoder_parts(model)[1], layer_ids) as captured:
        spec = speculative_generate(model, captured, layer_ids, DraftProposer(draft), prompt, K, 8, stop)
    assert spec.tokens == cut


def test_kimi_stop_ids_include_end_of_turn(kimi_target):
    info = load_target_info(kimi_target, trust_remote_code=True)
    assert {163585, 163586} <= info.stop_ids


# --- statistics and prompts ------------------------------------------------------------------


def test_acceptance_statistics():
    stats = SpeculativeStats(3)
    stats.add(Generation(prompt_len=5, tokens=[1] * 9, accepted=[3, 0, 1]))
    stats.add(Generation(prompt_len=5, tokens=[1] * 4, accepted=[2]))
    assert stats.passes == 4
    assert stats.acceptance_length == pytest.approx(1 + 6 / 4)
    assert stats.acceptance_rate_per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    # with independent per-position rates the simulated formula gives the same expectation
    assert simulated_acceptance_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_prompts_end_before_the_first_supervised_token():
    ds = Dataset.from_dict({
        "sample_id": ["a", "b", "c", "d"],
        "input_ids": [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12]],
        "loss_mask": [[0, 0, 1, 1], [1, 1, 1], [0, 0], [0, 1, 0]],
        "num_tokens": [4, 3, 2, 3],
    })
    prompts, skipped = select_prompts(ds, max_prompts=2)
    assert [(p.sample_id, p.ids) for p in prompts] == [("a", [1, 2]), ("d", [10])]
    assert skipped == 2  # "c" has no supervised token, "b" nothing before its first
    prompts, _ = select_prompts(ds, max_prompts=5, rows=[0, 3])
    assert [p.row for p in prompts] == [0, 3]
    with pytest.raises(PipelineError, match="candidate"):
        select_prompts(ds, max_prompts=1, rows=[1, 2])


def test_side_by_side_table():
    offline = {"simulated_acceptance_length": 1.5, "val_loss": 2.0, "full_acc": [0.4, 0.1, 0.0],
               "cond_acc": [0.4, 0.25, 0.0]}
    table = summary_table([DraftReport("draft", "a", offline=offline),
                           DraftReport("reference", "b", offline={**offline, "val_loss": 3.0})], K)
    lines = table.splitlines()
    assert lines[0].split() == ["draft", "reference"]
    assert any(line.split()[-2:] == ["2.000", "3.000"] for line in lines if line.startswith("validation loss"))
    assert sum("cond. accuracy" in line for line in lines) == K


def test_gap_between_measured_and_simulated_is_explained():
    stats = SpeculativeStats(K)
    stats.add(Generation(prompt_len=3, tokens=[1] * 5, accepted=[0, 0, 1]))  # measured 1.333
    close = DraftReport("close", "a", MeasuredResult(K, stats, []), {"simulated_acceptance_length": 1.4})
    far = DraftReport("far", "b", MeasuredResult(K, stats, []), {"simulated_acceptance_length": 1.8})
    notes = gap_notes([close, far])
    assert len(notes) == 1 and notes[0].startswith("note: far measures 1.333 but simulates 1.800")


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
    run_script("01_prepare_data.py", *common, "--input", demo_conversations, "--max-samples", str(SAMPLES),
               "--max-len", "256", "--output", run / "conversations")
    self_distill(run / "conversations", kimi_target, run / "prepared", NEW_TOKENS)
    run_script("02_extract_hidden_states.py", *common)
    run_script("03_build_vocab_map.py", *common, "--draft-vocab-size", "1024")
    export_untrained(kimi_target, run / "untrained")
    return run


def test_script_reports_measured_and_offline_figures(eval_run, kimi_target, tmp_path):
    reference = export_untrained(kimi_target, tmp_path / "reference", seed=1)
    out = tmp_path / "eval.json"
    proc = run_script(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                      "--draft", eval_run / "untrained", "--reference", reference, "--max-prompts", "2",
                      "--max-new-tokens", "12", "--max-samples", "3", "--json", out)
    report = json.loads(out.read_text())
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
    tests/test_speculative.py), so outputs are not compared token by token with greedy decoding."""
    out = tmp_path / "eval.json"
    run_script(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
               "--draft", eval_run / "untrained", "--max-prompts", "2", "--max-new-tokens", "12",
               "--temperature", "1.0", "--top-p", "0.9", "--json", out)
    report = json.loads(out.read_text())
    assert report["temperature"] == 1.0 and report["top_p"] == 0.9
    assert report["identical_to_greedy"] is None
    assert 1.0 <= report["measured_acceptance_length"] <= 1 + K
    assert 1.0 <= report["baselines"]["ngram"]["measured_acceptance_length"] <= 1 + K
    proc = run_script(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                      "--draft", eval_run / "untrained", "--top-p", "0.5", check=False)
    assert proc.returncode == 1 and "--top-p 0.5 needs --temperature > 0" in proc.stderr


@pytest.mark.slow
def test_trained_draft_accepts_more_than_an_untrained_one(eval_run, kimi_target):
    """04 on the self-distilled run (exporting its best checkpoint), then 05 against the untrained
    draft and the n-gram baseline on 04's validation rows: the trained draft measures a higher
    acceptance length than both, below k + 1, close to its simulated one, on a target that
    writes text rather than loops."""
    common = ["--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code"]
    run_script("04_train.py", *common, "--draft-config", TINY_CONFIG, "--epochs", "10", "--lr", "0.01",
               "--total-seq-len", "512", "--noise-std", "0", "--val-ratio", "0.2")
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
    # On the target's own continuations the measured figure is close to the simulated one: a
    # misaligned proposer (states of the wrong position or layer) would measure about 1 (seen: 1.54
    # measured, 1.60 simulated, n-gram 1.11).
    assert trained["measured_acceptance_length"] > trained["simulated_acceptance_length"] - 0.15


def rewrite_config(draft: Path, out: Path, edit) -> Path:
    shutil.copytree(draft, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("case, message", [
    ("hidden", "has hidden size 32, but target"),
    ("layers", "reads auxiliary layers [2, 4, 8], but target"),
    ("vocab", "maps a target vocabulary of"),
    ("not_speculators", "is not a speculators EAGLE-3 draft"),
    ("no_config", "no readable config.json"),
])
def test_draft_that_does_not_fit_is_refused(eval_run, kimi_target, flat_target, tmp_path, case, message):
    draft = eval_run / "untrained"
    folder = {
        "hidden": lambda: rewrite_config(draft, tmp_path / "d", lambda c: c["transformer_layer_config"].update(
            hidden_size=32)),
        "layers": lambda: rewrite_config(draft, tmp_path / "d", lambda c: c.update(
            eagle_aux_hidden_state_layer_ids=[2, 4, 8])),
        "vocab": lambda: export_untrained(flat_target, tmp_path / "d"),
        "not_speculators": lambda: kimi_target,
        "no_config": lambda: tmp_path,
    }[case]()
    with pytest.raises(PipelineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_draft(folder, load_target_info(kimi_target, trust_remote_code=True))


def test_script_exits_1_with_one_line_on_a_bad_draft(eval_run, kimi_target):
    proc = run_script(SCRIPT, "--run-dir", eval_run, "--target", kimi_target, "--trust-remote-code",
                      "--draft", kimi_target, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: draft ")
    assert "is not a speculators EAGLE-3 draft" in proc.stderr
