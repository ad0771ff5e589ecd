"""common/defaults.py: the built-in paths, and the cache name of a built-in target, which follows the
fixture code and the demo corpus without importing the miniatures package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from common import defaults
from common.defaults import DATA_DIR, REPO_ROOT, cached_target_path, demo_inputs, miniature_key


def test_demo_inputs_are_every_shipped_demo_file():
    names = [p.name for p in demo_inputs()]
    assert names == sorted(names) and {"demo_conversations.jsonl", "demo_agentic.jsonl"} <= set(names)
    assert all(p.parent == DATA_DIR == REPO_ROOT / "data" for p in demo_inputs())


def test_cache_key_follows_the_fixture_code(tmp_path, monkeypatch):
    key = miniature_key()
    code = Path(shutil.copytree(defaults.MINIATURES_DIR, tmp_path / "miniatures",
                                ignore=shutil.ignore_patterns("__pycache__")))
    monkeypatch.setattr(defaults, "MINIATURES_DIR", code)
    assert miniature_key() == key
    (code / "kimi_k25_code" / "chat_template.jinja").write_text("{{ messages }}")
    assert miniature_key() != key
    assert cached_target_path("kimi").name == f"kimi-v{defaults.MINIATURE_VERSION}-{miniature_key()}"


def test_script_help_imports_neither_the_miniatures_nor_compressed_tensors():
    """01 and 03 start without the miniature-LM trainer or compressed-tensors (production code never
    imports the miniatures package)."""
    probe = ("import runpy, sys; sys.argv = [sys.argv[1], '--help']\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "bad = sorted(m for m in sys.modules if m.startswith(('common.miniatures', 'compressed_tensors')))\n"
             "print('LOADED', bad)")
    for script in ("01_prepare_data.py", "03_build_vocab_map.py"):
        out = subprocess.run([sys.executable, "-c", probe, str(REPO_ROOT / script)], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=300)
        assert "LOADED []" in out.stdout, (script, out.stdout[-500:], out.stderr[-2000:])


def test_cache_key_follows_the_corpus(tmp_path, monkeypatch):
    key = miniature_key()
    for path in demo_inputs(DATA_DIR):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(defaults, "DATA_DIR", tmp_path)
    assert miniature_key() == key
    (tmp_path / "demo_more.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert miniature_key() != key
