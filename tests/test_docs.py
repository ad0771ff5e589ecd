"""README.md and docs/**/*.md point at what exists, and say what is rather than what changed.

- Links: every relative link resolves: the file exists and, with a #fragment, the target page has a
  heading of that GitHub-style anchor.
- Paths in code spans: every `backticked` repository path exists (`repository_paths` gives the rule).
- Narrative of change: no phrase that dates the text against an earlier state of the project
  (`NARRATIVE`), such as "fixed since" or "stop 38"; write what is, and keep dated comparisons of two
  commits in docs/measurements/ with the commits named.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`([^`]+)`")

# A bare file name (no "/") with one of these endings names a file at the repository's root: the numbered
# scripts, pyproject.toml, README.md. Other bare names (prepare_report.json, t2d.pt, config.json) are the
# files of a run folder or a checkpoint, which docs/FILES.md describes; write a repository file that is
# not at the root with its folder (tests/test_vllm.py, not test_vllm.py).
ROOT_FILE_SUFFIXES = (".py", ".sh", ".toml", ".md")
# Characters that make a span a pattern or a placeholder, not one path: globs (data/demo_*.jsonl), fields
# (data_{i}.pt), placeholders (checkpoints/<epoch>/), alternatives (hf|vllm), shell variables ($RUN/eval.json).
NOT_ONE_PATH = re.compile(r"[*?\[\]{}<>|$\\\"'`]")
URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)

# Phrases that narrate the project's history instead of describing it (prose only; code spans, such as
# the bench variant `before`, are not prose).
NARRATIVE = re.compile(
    r"\b(stop|issue)\s+#?\d+\b"                   # stop 38, issue 33: the tracker's history
    r"|\b(fixed|has|have|had)\s+since\b"         # fixed since, has since risen
    r"|\bsince\s+the\s+last\s+(change|commit|run)\b"
    r"|\bdefaults?\s+(before|then)\b"           # the defaults before, defaults then
    r"|\bbefore\s+this\s+(layout|change|commit)\b",
    re.IGNORECASE,
)


def prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a `# comment` in bash is no heading)."""
    lines, inside = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def prose_text(path: Path) -> str:
    """The prose as one text, so that a code span broken over two lines is read as one span."""
    return "\n".join(prose(path))


def anchors(path: Path) -> set[str]:
    """GitHub's anchors: lower case, punctuation other than - and _ dropped, spaces to -, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in prose(path):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        found += [target for target in LINK.findall(line) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]
    return found


def ignored_patterns() -> list[str]:
    """The patterns of the repository's .gitignore (blank lines and comments left out)."""
    gitignore = ROOT / ".gitignore"
    text = gitignore.read_text(encoding="utf-8") if gitignore.is_file() else ""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def is_ignored(path: str, patterns: list[str]) -> bool:
    """Whether .gitignore covers the path or a folder above it (runs/, .cache/, .venv-vllm/, data/prompt_sets/):
    a pattern with an inner "/" matches the path from the root, one without matches any single component."""
    parts = [part for part in path.split("/") if part]
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        anchored = "/" in pattern
        pattern = pattern.lstrip("/")
        for depth in range(1, len(parts) + 1):
            if anchored and fnmatch.fnmatchcase("/".join(parts[:depth]), pattern):
                return True
            if not anchored and fnmatch.fnmatchcase(parts[depth - 1], pattern):
                return True
    return False


def repository_path(word: str, top_level: set[str], patterns: list[str]) -> str | None:
    """The repository path a word of a code span names, or None when it names none.

    A word is a repository path when it is not a URL, a flag (-x, --x), an absolute path (/models/...),
    a pattern or placeholder (any of * ? [ ] { } < > | $), or covered by .gitignore (runs/, .cache/,
    .venv-vllm/, bench/out/: made by running things, not kept in the repository), and either
    - it holds a "/" and its first component is an entry of the repository's root (common/, bench/,
      tests/, .ci/, ...): paths under other roots (RUN/prepared/, moonshotai/Kimi-K2.5, vLLM's
      vllm/transformers_utils/..., a checkpoint's checkpoints/...) are not this repository's; or
    - it has no "/" and ends in .py, .sh, .toml or .md (04_train.py, pyproject.toml): a root file.
    Punctuation around a word (a colon or comma after a path in prose, parentheses) is not part of it."""
    word = word.lstrip("(").rstrip(":,;)")
    if not word or URL.match(word) or word.startswith(("-", "/", "~")) or NOT_ONE_PATH.search(word):
        return None
    if "/" in word:
        first = word.split("/", 1)[0]
        if first not in top_level or first in (".", ".."):
            return None
    elif not word.endswith(ROOT_FILE_SUFFIXES) or word.startswith("."):
        return None
    return None if is_ignored(word, patterns) else word


def repository_paths(page: Path) -> list[str]:
    """Every repository path the page writes in a code span outside fenced blocks.

    A span without spaces is one word. A span with spaces is a command line (`python bench/run_all.py
    --quick`) or prose: each of its words is checked alone by `repository_path`, and the module after
    `-m` (`python -m common.miniatures kimi`), when its first component is a folder of the repository,
    is checked as that folder's package or module file."""
    top_level = {entry.name for entry in ROOT.iterdir()}
    patterns = ignored_patterns()
    found = []
    for span in CODE_SPAN.findall(prose_text(page)):
        words = span.split()
        for i, word in enumerate(words):
            path = repository_path(word, top_level, patterns)
            if path is not None:
                found.append(path)
            if word == "-m" and i + 1 < len(words) and re.fullmatch(r"[\w.]+", words[i + 1]):
                parts = words[i + 1].split(".")
                if (ROOT / parts[0]).is_dir():
                    module = "/".join(parts)
                    found.append(module if (ROOT / module).is_dir() else module + ".py")
    return found


def test_pages_exist() -> None:
    assert (ROOT / "docs" / "FILES.md").is_file() and len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_backticked_paths_exist() -> None:
    """One failure lists every missing path with the page that names it."""
    missing = []
    for page in PAGES:
        for path in dict.fromkeys(repository_paths(page)):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: `{path}`")
    assert not missing, "repository paths in code spans that do not exist:\n" + "\n".join(missing)


def test_path_rule() -> None:
    """The rule on examples of each kind the pages use."""
    top, ignore = {"common", "bench", "tests", ".ci", "04_train.py", "runs", "data"}, ["runs/", "data/prompt_sets/"]
    named = {word: repository_path(word, top, ignore) for word in [
        "common/draft/patch.py", "bench/", ".ci/run", "04_train.py", "tests/test_vllm.py,", "pyproject.toml",
        "RUN/prepared/", "runs/default/draft", "data/prompt_sets/", "moonshotai/Kimi-K2.5", "vllm/platforms/cpu.py",
        "data/demo_*.jsonl", "data_{i}.pt", "checkpoints/<epoch>/", "--num-shards/--shard-index", "/models/K",
        "https://example.org/a.py", "prepare_report.json", "t2d.pt", "chat_template.jinja", "hf|vllm"]}
    assert {word for word, path in named.items() if path} == {
        "common/draft/patch.py", "bench/", ".ci/run", "04_train.py", "tests/test_vllm.py,", "pyproject.toml"}
    assert named["tests/test_vllm.py,"] == "tests/test_vllm.py"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_narrative_of_change(page: Path) -> None:
    text = CODE_SPAN.sub("``", prose_text(page))
    found = []
    for match in NARRATIVE.finditer(text):
        line = text[text.rfind("\n", 0, match.start()) + 1:].split("\n", 1)[0]
        found.append(f"{match.group(0)!r} in: {line.strip()[:120]}")
    assert not found, f"{page.relative_to(ROOT)}: history instead of what is:\n" + "\n".join(found)


def test_narrative_rule() -> None:
    """History is flagged; "before" and "since" in their plain senses (order, cause) are not."""
    flagged = ["fixed since", "its rate has since risen", "the defaults before", "defaults then", "CI (stop 38)",
               "issue 33's variants", "Before this layout the suite"]
    plain = ["run 01 before 02", "since upstream applies that norm", "the checkpoint before", "the defaults (lr 1.8e-2)"]
    assert [text for text in flagged if not NARRATIVE.search(text)] == []
    assert [text for text in plain if NARRATIVE.search(text)] == []
