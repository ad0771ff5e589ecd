"""The upstream rows of bench/bench_04_recipe.py: the same draft trained by speculators 0.9.0's own
trainer, in its own environment `.venv-speculators/` (scripts/setup_speculators_env.sh),
on the same data, vocabulary, draft shape and budget as 04, then served by 05 like 04's drafts.

1. `convert_data`: 02's hidden states and 03's vocabulary in the layout upstream's trainer reads
   (`RUN_DIR/upstream-data/`): a `datasets` folder of `input_ids`/`loss_mask`/`seq_len` rows,
   `hidden_states/hs_{i}.safetensors` ([seq, 4, H]: the three auxiliary states, then the last one;
   `token_ids`), `d2t.npy`/`t2d.npy`, and the draft's decoder config. Rows are 04's training rows
   first and its held-out rows last, so upstream's sequential split (first `train_data_ratio`
   of the rows) trains on exactly 04's training rows and 05's held-out prompts stay unseen. 02
   stores the final state after the target's norm (the lm_head's input) while upstream applies
   the target's norm itself (`verifier_norm`), so the last state is divided by the norm's weight:
   RMSNorm is scale-invariant, so upstream's norm of it gives 02's state back.
2. `train`: bench/upstream/train.py in that environment (its trainer, patched for CPU there).
3. `export`: the last epoch's checkpoint renamed into 04's draft folder format (speculators 0.3.0
   config, bf16, d2t/t2d, 04's `validation_split.json`), which 05 and vLLM load like 04's drafts.

The drafts keep 04's default architecture (`--no-norm-before-fc --no-norm-output`: no RMSNorm before
`fc`, the pre-norm state fed across TTT steps) unless the variant asks for upstream's eagle3 defaults
(`upstream-31-*`: both norms, EAGLE-3.1), which 04's drafts have as a config option
(common/draft/eagle31.py). Everything else is upstream's own: its loss (KL to the target, or the
variant's `--loss-fn`), Muon's weight decay 0.1, no noise augmentation, no `post_init` seed of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from common.atomic import write_dir, write_json
from common.defaults import REPO_ROOT
from common.draft.model import WEIGHTS_FILE, export_draft, read_config_file, speculator_config
from common.extract.vllm_engine import final_norm_of
from common.hidden_states.loader import SPLIT_FILE, HiddenStateData, load_hidden_states, split_data, split_record
from common.target.config import load_target_info
from common.train.settings import TrainSettings
from common.vocab import load_vocab

UPSTREAM_PYTHON = REPO_ROOT / ".venv-speculators" / "bin" / "python"
TRAIN_SCRIPT = Path(__file__).resolve().with_name("train.py")  # run by UPSTREAM_PYTHON
SETUP = "scripts/setup_speculators_env.sh"
DATA_DIR = "upstream-data"
LAYER_CONFIG = "draft_layer_config.json"
CONVERSION = "conversion.json"
# The decoder config upstream builds the draft from (`--draft-config`): 04's, for this target.
LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "vocab_size", "rms_norm_eps", "rope_theta",
              "rope_scaling", "max_position_embeddings", "initializer_range", "attention_bias", "mlp_bias",
              "tie_word_embeddings")
# Its flags for the CPU (see bench/upstream/train.py), and 04's architecture (module docstring).
CPU_FLAGS = ("--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
             "--num-workers", "0")
ARCHITECTURE_FLAGS = ("--no-norm-before-fc", "--no-norm-output")
# Upstream keeps these in its checkpoints; 04's drafts do not have them (vLLM reads embed_tokens
# from the target when absent, but 04's drafts carry it, so it is kept).
DROPPED = ("verifier_norm.weight", "verifier_lm_head.weight")

VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {  # name -> (row label, upstream flags)
    "upstream-muon": ("speculators 0.9.0: Muon, lm_head frozen", ()),
    "upstream-muon-head": ("speculators 0.9.0: Muon, lm_head trained", ("--trainable-lm-head",)),
    "upstream-adamw": ("speculators 0.9.0: AdamW, lm_head frozen", ("--optimizer", "adamw")),
    # its eagle3 defaults (EAGLE-3.1's norms), and its acceptance loss (`nla`, the LK loss)
    "upstream-31-head": ("speculators 0.9.0: EAGLE-3.1 norms, lm_head trained",
                         ("--trainable-lm-head", "--norm-before-fc", "--norm-output")),
    "upstream-31-head-lk": ("speculators 0.9.0: EAGLE-3.1 norms, lm_head trained, LK loss (nla)",
                            ("--trainable-lm-head", "--norm-before-fc", "--norm-output", "--loss-fn", "nla")),
}


@dataclass
class Split:
    data: HiddenStateData
    train: list[Path]
    val: list[Path]
    settings: TrainSettings


def available() -> bool:
    return UPSTREAM_PYTHON.is_file()


def missing_message() -> str:
    return f"upstream variants skipped: no {UPSTREAM_PYTHON.parent.parent.name}/ (create it: bash {SETUP})"


def config_settings(config: Path) -> TrainSettings:
    """04's training settings of the draft config `config` (the bench's budget)."""
    return TrainSettings.resolve(read_config_file(config), {})[0]


def split(run_dir: Path, config: Path) -> Split:
    """04's split of the run's hidden states under the settings of the draft config `config`."""
    settings = config_settings(config)
    data = load_hidden_states(run_dir / "hidden_states")
    train, val = split_data(data, settings)
    return Split(data, train, val, settings)


def convert_data(run_dir: Path, target: Path, config: Path) -> Path:
    """The run's states and vocabulary in upstream's layout, the draft shape and split of `config`
    (converted once per run folder)."""
    out = run_dir / DATA_DIR
    if (out / CONVERSION).is_file():
        return out
    from datasets import Dataset  # imported late: only the upstream rows need it

    s = split(run_dir, config)
    if s.data.config.storage != "bf16":
        raise SystemExit(f"upstream variants: hidden states stored as {s.data.config.storage}; only bf16 is converted")
    info = load_target_info(target, trust_remote_code=True)  # the miniatures, or a target the user passed
    norm, _ = final_norm_of(info)  # 02's reader of it (flat or nested checkpoints)
    vocab = load_vocab(run_dir / "vocab", info.vocab_size)
    shape = read_config_file(config).model
    layers = speculator_config(shape, info, vocab.d2t.numel(), s.data.config.layer_ids, s.settings.ttt_steps)
    order = s.train + s.val

    def fill(tmp: Path) -> None:
        (tmp / "hidden_states").mkdir()
        rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        for i, path in enumerate(order):
            sample = torch.load(path, weights_only=True)
            *aux, last = (state.float() for state in sample["hidden_states"])
            states = torch.stack([*aux, last / norm], dim=1)  # [seq, 4, H]
            save_file({"hidden_states": states, "token_ids": sample["input_ids"]},
                      str(tmp / "hidden_states" / f"hs_{i}.safetensors"))
            rows["input_ids"].append(sample["input_ids"].tolist())
            rows["loss_mask"].append(sample["loss_mask"].tolist())
            rows["seq_len"].append(len(sample["input_ids"]))
        dataset = Dataset.from_dict(rows)
        dataset.set_format("torch")
        dataset.save_to_disk(str(tmp))
        np.save(tmp / "d2t.npy", vocab.d2t.numpy())
        np.save(tmp / "t2d.npy", vocab.t2d.numpy())
        layer = layers.transformer_layer_config.to_dict()
        write_json(tmp / LAYER_CONFIG, {k: layer[k] for k in LAYER_KEYS})
        # The ratio whose int(rows * ratio) is 04's training row count (upstream's split boundary).
        write_json(tmp / CONVERSION, {"rows": len(order), "train_rows": len(s.train),
                                      "train_data_ratio": (len(s.train) + 0.5) / len(order),
                                      "layer_ids": s.data.config.layer_ids, "source": str(run_dir / "hidden_states")})

    write_dir(out, fill)
    return out


def train_flags(data_dir: Path, target: Path, out: Path, seed: int, lr: float | None,
                epochs: int | None, config: Path) -> list[str]:
    """04's budget (the draft config `config`; `lr` and `epochs` in place of its own) in upstream's flags;
    `seed` is its initialisation's and packing order's (the split is fixed by the conversion).
    Paths are absolute: the trainer runs in `out`."""
    data_dir, target, out = data_dir.resolve(), Path(target).resolve(), out.resolve()
    conversion = json.loads((data_dir / CONVERSION).read_text())
    settings = config_settings(config)
    return ["--verifier-name-or-path", str(target), "--data-path", str(data_dir),
            "--draft-config", str(data_dir / LAYER_CONFIG),
            "--target-layer-ids", *map(str, conversion["layer_ids"]),
            "--d2t-path", str(data_dir / "d2t.npy"), "--t2d-path", str(data_dir / "t2d.npy"),
            "--train-data-ratio", str(conversion["train_data_ratio"]), "--on-missing", "raise",
            # unused by EAGLE-3 drafts; unset, upstream loads the target's processor to find one, which for
            # Kimi-K2.5's vision-language config needs torchvision (not installed there: setup_speculators_env.sh)
            "--mask-token-id", str(load_target_info(target, trust_remote_code=True).pad_token_id or 0),
            "--epochs", str(epochs or settings.epochs), "--lr", str(lr or settings.lr), "--ttt-steps", str(settings.ttt_steps),
            "--total-seq-len", str(settings.total_seq_len), "--scheduler-type", settings.scheduler,
            "--seed", str(seed), "--save-path", str(out / "checkpoints"), "--log-dir", str(out / "logs"),
            *CPU_FLAGS, *ARCHITECTURE_FLAGS]


def last_checkpoint(out: Path) -> Path | None:
    epochs = sorted(int(p.name) for p in (out / "checkpoints").glob("[0-9]*") if (p / WEIGHTS_FILE).is_file())
    return out / "checkpoints" / str(epochs[-1]) if epochs else None


def train(data_dir: Path, target: Path, out: Path, flags: tuple[str, ...], seed: int, lr: float | None,
          epochs: int | None, config: Path) -> Path:
    """Upstream's trainer (bench/upstream/train.py); it resumes from its own checkpoints when run again."""
    done = last_checkpoint(out)
    if done is not None and int(done.name) == (epochs or config_settings(config).epochs) - 1:
        return done
    return run_trainer(out, [*train_flags(data_dir, target, out, seed, lr, epochs, config), *flags])


def run_trainer(out: Path, args: list[str]) -> Path:
    """bench/upstream/train.py with `args` in upstream's environment; its last checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "upstream_train.log"
    with log.open("w") as f:
        proc = subprocess.run([str(UPSTREAM_PYTHON), str(TRAIN_SCRIPT), *args],
                              cwd=out, stdout=f, stderr=subprocess.STDOUT, env=os.environ | {"TQDM_DISABLE": "1"},
                              check=False)
    done = last_checkpoint(out)
    if proc.returncode != 0 or done is None:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"upstream training exited {proc.returncode} (log {log}):\n{tail}")
    return done


def timed_epochs(data_dir: Path, target: Path, out: Path, flags: tuple[str, ...], epochs: int,
                 config: Path, seed: int = 0) -> list[float]:
    """Seconds of each training epoch of a fresh upstream run of `epochs` epochs into `out`, the
    budget of the draft config `config` (bench/bench_04_train.py)."""
    seconds = out.resolve() / "epoch_seconds.json"  # the trainer runs in `out`
    run_trainer(out, [*train_flags(data_dir, target, out, seed, None, epochs, config), *flags,
                      "--epoch-seconds", str(seconds)])
    return json.loads(seconds.read_text())


def export(run_dir: Path, target: Path, checkpoint: Path, out: Path, seed: int, config: Path) -> Path:
    """The checkpoint as a 04 draft folder (its config as 04 writes it for the draft config `config`'s
    shape; its split record names the run's `seed`)."""
    saved = json.loads((checkpoint / "config.json").read_text())
    if saved.get("fc_norm"):
        raise SystemExit(f"{checkpoint}: fc_norm set; 04's draft format has no such norms")
    s = split(run_dir, config)
    info = load_target_info(target, trust_remote_code=True)  # the miniatures, or a target the user passed
    vocab = load_vocab(run_dir / "vocab", info.vocab_size)
    shape = replace(read_config_file(config).model, norm_before_fc=bool(saved.get("norm_before_fc")),
                    norm_output=bool(saved.get("norm_output")))
    speculator = speculator_config(shape, info, vocab.d2t.numel(), s.data.config.layer_ids, s.settings.ttt_steps)
    state = {k: v for k, v in load_file(str(checkpoint / WEIGHTS_FILE)).items() if k not in DROPPED}
    whole = vocab.d2t.numel() == info.vocab_size  # upstream then keeps no maps, as export_draft writes none
    if any(not torch.equal(state[k], v) if k in state else not whole for k, v in (("d2t", vocab.d2t), ("t2d", vocab.t2d))):
        raise SystemExit(f"{checkpoint}: its vocabulary maps are not {run_dir / 'vocab'}'s")
    with tempfile.TemporaryDirectory(dir=out) as tmp:  # what export_draft reads: a folder with model.safetensors
        save_file(state, str(Path(tmp) / WEIGHTS_FILE), metadata={"format": "pt"})
        return export_draft(Path(tmp), speculator, out / "draft",
                            {SPLIT_FILE: split_record(s.data, s.train, s.val, replace(s.settings, seed=seed), out / "draft"),
                             "upstream_checkpoint.json": {"checkpoint": str(checkpoint), "config": saved}})


def train_and_export(run_dir: Path, target: Path, out: Path, flags: tuple[str, ...], seed: int,
                     lr: float | None, epochs: int | None, config: Path) -> Path:
    """OUT/draft, trained by upstream with `seed` on the draft config `config`'s shape and budget (`lr`
    and `epochs` in place of its own when given; the data converted once for all variants)."""
    print(f"{out.name}: speculators 0.9.0 {' '.join(flags) or '(its defaults)'}, seed {seed}, lr {lr or 'of the config'}"
          f", epochs {epochs or 'of the config'}", flush=True)
    checkpoint = train(convert_data(run_dir, target, config), target, out, flags, seed, lr, epochs, config)
    return export(run_dir, target, checkpoint, out, seed, config)
