"""common/cli.py: the run folder's stage folders, the built-in target, the one-line error exit."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from common.cli import STAGES, add_run_args, builtin_target, resolve_target, stage_dir
from common.defaults import DEFAULT_RUN_DIR, REPO_ROOT, cached_target_path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    return parser.parse_args(list(argv))


def test_stage_folders_live_under_the_run_folder(tmp_path):
    args = parse("--run-dir", str(tmp_path))
    assert [stage_dir(args, s) for s in STAGES] == [tmp_path / s for s in STAGES]
    assert stage_dir(args, "prepared", tmp_path / "elsewhere") == tmp_path / "elsewhere"
    assert parse().run_dir == DEFAULT_RUN_DIR
    with pytest.raises(ValueError, match="unknown stage folder 'preparde'"):
        stage_dir(args, "preparde")


def test_target_flag_or_the_builtin_one(kimi_target, tmp_path):
    assert resolve_target(parse("--target", str(tmp_path))) == (tmp_path, False)
    assert resolve_target(parse("--target", str(tmp_path), "--trust-remote-code")) == (tmp_path, True)
    # the session fixture built the cache: the default is that folder, its remote code trusted
    assert resolve_target(parse()) == (cached_target_path("kimi"), True) == (builtin_target(), True)


def test_an_error_is_one_line_and_exit_1(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("from common.cli import run_main\nfrom common.errors import PipelineError\n\n"
                      "def main():\n    raise PipelineError('data.jsonl line 3: not JSON')\n\nrun_main(main)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert (proc.returncode, proc.stderr) == (1, "error: data.jsonl line 3: not JSON\n")


@pytest.mark.parametrize(("raised", "status", "last"), [
    ("KeyboardInterrupt", 130, "interrupted: finished files are kept; run the same command again to resume"),
    ("Terminated", 143, "terminated: finished files are kept; run the same command again to resume"),
])
def test_a_library_error_raised_while_unwinding_an_interrupt_exits_as_the_interrupt(tmp_path, raised, status, last):
    """A signal that lands inside torch's functorch (a vmap layer pushed) unwinds into torch's own
    RuntimeError, with the interrupt in its chain: the script still exits as interrupted, no traceback;
    an error with no interrupt behind it is still a traceback."""
    script = tmp_path / "interrupted.py"
    script.write_text("import sys\nfrom common.cli import Terminated, run_main\n\n"
                      "def main():\n    try:\n        raise " + raised + "\n    finally:\n"
                      "        if sys.argv[1:] == ['library']:\n"
                      "            raise RuntimeError('layerId == dynamic_layer.layerId() INTERNAL ASSERT FAILED')\n\n"
                      "run_main(main)\n")
    for args in ([], ["library"]):
        proc = subprocess.run([sys.executable, str(script), *args], check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                              env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
        assert (proc.returncode, proc.stderr.strip()) == (status, last), proc.stderr
    plain = tmp_path / "bug.py"
    plain.write_text("from common.cli import run_main\n\ndef main():\n    raise RuntimeError('a bug')\n\n"
                     "run_main(main)\n")
    proc = subprocess.run([sys.executable, str(plain)], check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and proc.stderr.strip().endswith("RuntimeError: a bug")
