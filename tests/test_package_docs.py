"""Docs integrity: every relative link and backticked repository path in README.md, docs/*.md and
the package READMEs exists, and README.md stays short.
A failure names the file, line and path: fix the reference (a file moved or was renamed) or restore
the file."""

from __future__ import annotations

import glob
import itertools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^\s*(```|~~~)")
# characters that end a path written inside prose or a command (quotes, punctuation, a line number)
TRAILING = ".,;:'\""
CLOSERS = {")": "(", "]": "[", "}": "{"}
LEADING = "('\"[{<"


def _top_level_dirs() -> frozenset[str]:
    """Top-level folders of the repository: the ones holding tracked or not-ignored files."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        dirs = {line.split("/", 1)[0] for line in out.splitlines() if "/" in line}
    except (OSError, subprocess.CalledProcessError):
        dirs = {p.name for p in ROOT.iterdir() if p.is_dir()}
    return frozenset(d for d in dirs if not d.startswith(".") and (ROOT / d).is_dir())


TOP = _top_level_dirs()


def _doc_files(extra_readmes: bool) -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if extra_readmes:
        files += sorted(
            Path(p) for p in glob.glob(str(ROOT / "real_py" / "**" / "README.md"), recursive=True)
        )
        files += [p for p in [ROOT / "bench" / "README.md"] if p.exists()]
    return files


def _lines_outside_fences(text: str):
    """(line number, line, in_fence) for every line."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        yield n, line, fenced


def _expand(path: str) -> list[str]:
    """`a/{b,c}.md` -> [a/b.md, a/c.md] (one level of braces, as the docs write file pairs)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return list(
        itertools.chain.from_iterable(
            _expand(path[: m.start()] + alt + path[m.end() :]) for alt in m.group(1).split(",")
        )
    )


def _exists(rel: str, base: Path) -> bool:
    rel = rel.split("#", 1)[0].split("?", 1)[0]
    if not rel:
        return True  # a pure anchor
    for p in _expand(rel):
        if any(c in p for c in "*?["):
            if not glob.glob(str(base / p)):
                return False
        elif not (base / p).exists():
            return False
    return True


def _rstrip(word: str) -> str:
    """Strip trailing punctuation, and closing brackets that close nothing inside the word."""
    while word:
        c = word[-1]
        if c in TRAILING or (c in CLOSERS and word.count(c) > word.count(CLOSERS[c])):
            word = word[:-1]
        else:
            break
    return word


def _clean_word(word: str) -> str:
    word = word.lstrip(LEADING)
    if "=" in word and not word.startswith(("-", "=")):
        word = word.split("=", 1)[1]  # KEY=configs/x.yaml, ARGS="..."
    word = word.lstrip(LEADING)
    word = word.split("::", 1)[0]  # pytest node ids
    word = re.sub(r":\w*$", "", _rstrip(word))  # file.py:fn, file.py:123
    return _rstrip(word)


def _repo_paths(span: str):
    """Words of a code span or code line that name a repository path: they contain a '/' and
    start with a top-level folder. Placeholders (<name>, ...) and the argument of --out (a file a
    command writes) are skipped."""
    words = span.split()
    for i, raw in enumerate(words):
        w = _clean_word(raw)
        if "/" not in w or w.split("/", 1)[0] not in TOP:
            continue
        if "<" in w or ">" in w or "..." in w or "$" in w:
            continue
        if i > 0 and words[i - 1] in ("--out", "--out-dir", ">", "-o"):
            continue
        yield w


def references(path: Path):
    """(line, kind, target, base directory) for every link and repository path in a markdown
    file."""
    text = path.read_text(encoding="utf-8")
    for n, line, fenced in _lines_outside_fences(text):
        if fenced:
            for w in _repo_paths(line):
                yield n, "path in code block", w, ROOT
            continue
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            yield n, "link", target, path.parent
        for m in INLINE_CODE.finditer(line):
            for w in _repo_paths(m.group(1)):
                yield n, "backticked path", w, ROOT


def _git_ignored(target: str, base: Path) -> bool:
    """A path git ignores (a build or cache folder such as bench/.cache) is made by a command, not
    shipped: a reference to it is no broken link."""
    rel = target.split("#", 1)[0].rstrip("/")
    try:
        # as a file, and as a folder (a pattern such as `bench/.cache/` matches folders only)
        return any(
            subprocess.run(
                ["git", "check-ignore", "-q", "--no-index", str(base / rel) + tail],
                cwd=ROOT,
                capture_output=True,
            ).returncode
            == 0
            for tail in ("", "/")
        )
    except OSError:
        return False


def broken(files) -> list[str]:
    out = []
    for f in files:
        for n, kind, target, base in references(f):
            if not _exists(target, base) and not _git_ignored(target, base):
                name = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
                out.append(f"{name}:{n}: {kind} {target!r} does not exist")
    return out


def test_readme_and_docs_references_exist():
    assert (ROOT / "docs").is_dir(), "docs/ is missing"
    bad = broken(_doc_files(extra_readmes=False))
    assert not bad, "broken references:\n" + "\n".join(bad)


def test_package_readmes_references_exist():
    files = [
        f for f in _doc_files(extra_readmes=True) if f.parent != ROOT and f.parent.name != "docs"
    ]
    bad = broken(files)
    assert not bad, "broken references:\n" + "\n".join(bad)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n < README_MAX_LINES, (
        f"README.md has {n} lines; keep it under {README_MAX_LINES} (details go to docs/)"
    )


def test_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    missing = sorted(pages - linked)
    assert not missing, f"docs/README.md does not link {missing}"


HISTORY = [
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
    (
        re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/.-])"),
        "a commit id",
    ),
    (re.compile(r"(?<![\w/.-])20\d\d-\d\d-\d\d(?![\w/.-])"), "a date"),
]


def test_readme_and_docs_hold_no_history():
    """README and docs describe the current state: no issue numbers, commit ids or dates (report
    file names may carry their date; git keeps the history)."""
    bad = []
    for f in _doc_files(extra_readmes=False):
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for rx, what in HISTORY:
                for m in rx.finditer(line):
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {what}: {m.group(0)!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text, want",
    [
        ("see [x](docs/nope.md) and `bench/results/nope_cpu2_20990101.md`", 2),
        ("`real_py/nope.py:fn` and ![img](nope.png)", 2),
        ("[web](https://example.com) `runs/train/x` `<out>/a` `--out bench/results/new.md`", 0),
    ],
)
def test_checker_can_fail(tmp_path, text, want):
    """The checker flags made-up references (and skips URLs, untracked folders and outputs)."""
    f = tmp_path / "page.md"
    f.write_text(text + "\n", encoding="utf-8")
    assert len(broken([f])) == want, broken([f])
