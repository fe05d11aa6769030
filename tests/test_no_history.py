"""The tree describes the product as it is: no development diary, and no dead links in the docs.

Narration is searched for in README.md, docs/, engine/, auditor/ and bench/: an ordinal with "session"
("seventeenth session"), "session N", a session-numbered folder ("2026-12-04-s17", "s17 results"),
per-commit folders ("at-9a78317"), "moved here / verbatim / from", and commit hashes in prose (a run of
7-40 lower-case hex characters holding a digit and a letter, standing alone as a word). Python files are
searched in their comments and strings only, so code (``0x9E3779B97F4A7C15``, ``s1 = ...``) is not
prose; JSON, raw logs under bench/results and other data files are not searched, since their hex digests
are data. Git history is the diary.

Links: every relative link and image of README.md and the Markdown under docs/ and bench/ must name a
file inside the repository, and an ``#anchor`` must name a heading of its target.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("README.md", "docs", "engine", "auditor", "bench")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".toml", ".ini", ".cfg", ".j2", ".html", ".mako"}

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+|\\d+(?:st|nd|rd|th)")
NARRATION = {
    "ordinal session": re.compile(rf"\b(?:{_ORDINALS})[ -]session\b", re.IGNORECASE),
    "session N": re.compile(r"\bsessions? \d+\b", re.IGNORECASE),
    "session folder": re.compile(r"\b\d{4}-\d{2}-\d{2}-s\d+\b|\(s\d{1,2}\)|(?<![\w./-])s\d{1,2}(?:/|\s+(?:results|figures"
                                 r"|folders?|files|runs?|index|readme|levers|tree|code|defaults)\b)", re.IGNORECASE),
    "per-commit folder": re.compile(r"\bat-[0-9a-f]{7,40}\b"),
    "moved note": re.compile(r"\bmoved (?:here|verbatim|from)\b", re.IGNORECASE),
}
# A lone run of hex holding a digit and a letter: not part of a longer word, identifier, path, UUID,
# number (1.5e-16) or URL.
COMMIT_HASH = re.compile(r"(?<![\w\-./+:#@%$])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w\-/+@]|\.\w)")
NOT_HASHES = {"ed25519"}


def _files(root: Path) -> Iterator[Path]:
    for name in SCANNED:
        top = root / name
        paths = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for path in paths:
            if not path.is_file() or path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts:
                continue
            if "results" in path.relative_to(root).parts[:2] and path.suffix != ".md":
                continue  # raw command output (pytest logs) is data; the results indexes are prose
            yield path


def _python_prose(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python source."""
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in kinds:
            for i, line in enumerate(tok.string.split("\n")):
                yield tok.start[0] + i, line


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        yield from _python_prose(text)
    else:
        yield from enumerate(text.split("\n"), start=1)


def narration(root: Path) -> list[str]:
    """Every narrating line under ``root``'s scanned paths, as ``path:line: kind: text``."""
    found = []
    for path in _files(root):
        for number, line in _prose(path):
            kinds = [kind for kind, pattern in NARRATION.items() if pattern.search(line)]
            kinds += ["commit hash" for m in COMMIT_HASH.finditer(line) if m.group() not in NOT_HASHES][:1]
            found += [f"{path.relative_to(root)}:{number}: {kind}: {line.strip()[:160]}" for kind in kinds]
    return found


def results_folders(root: Path) -> list[str]:
    """Results folders named by session or commit (they must be named by machine and date)."""
    results = root / "bench" / "results"
    named = [p for p in results.rglob("*") if p.is_dir()] if results.is_dir() else []
    return [str(p.relative_to(root)) for p in named
            if re.search(r"-s\d+$|^s\d+$|^at-[0-9a-f]{7,40}$|session", p.name)]


def test_the_tree_has_no_development_narration() -> None:
    found = narration(ROOT)
    assert not found, "development history in the tree (git keeps it):\n" + "\n".join(found)


def test_results_folders_are_named_by_machine_and_date() -> None:
    assert not results_folders(ROOT)


@pytest.mark.parametrize("line", [
    "Measured in the seventeenth session on the H200.",
    "# in the 12th session the kernel changed",
    "see session 16 for the figures",
    "files: bench/results/2026-12-04-s17/final17/gpu-bench-modes-mixes.json",
    "the s17 results are current",
    "folder at-9a78317 holds the runs",
    "The figures at main's defaults: 9a78317, one machine.",
    "Earlier blocks moved verbatim to docs/history.md.",
])
def test_planted_narration_is_found(tmp_path: Path, line: str) -> None:
    for where in ("README.md", "docs/notes.md", "engine/mod.py", "bench/run.sh"):
        path = tmp_path / where
        path.parent.mkdir(parents=True, exist_ok=True)
        body = f"x = 1  # {line}\n" if path.suffix == ".py" else line + "\n"
        path.write_text(body)
        assert narration(tmp_path), (where, line)
        path.unlink()


def test_data_and_code_are_not_narration(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "formats.md").write_text(
        "transcript 01a227a4-472d-774d-ad8d-9da0151722e5, digest "
        "376d2de1a688d077ae2b92e03497b2c2923e97a054a99f76c1c01c8b861e3600, kid fp_0123456789ab,\n"
        "Ed25519 and ed25519 keys, 0x9E3779B97F4A7C15, 1.1102230246251565e-16, gist.github.com/u/e3041f0029db,\n"
        "pass sessions of the console, a DB session, 16 tokens, 2026-12-04-h200/gpu-bench-modes-mixes.json\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "k.py").write_text(
        "GAMMA = 0x9E3779B97F4A7C15\ns1 = 3  # sin lanes\nID = 'triton-paged-v2-m16n64w4c256'\n")
    (tmp_path / "bench" / "results" / "2026-12-04-h200").mkdir(parents=True)
    assert narration(tmp_path) == [] and results_folders(tmp_path) == []
    (tmp_path / "bench" / "results" / "2026-12-04-s17").mkdir()
    assert results_folders(tmp_path) == ["bench/results/2026-12-04-s17"]


# --- links -------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE)}


def _markdown(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md")), *sorted((root / "bench").rglob("*.md"))]


def broken_links(root: Path) -> list[str]:
    broken = []
    for doc in _markdown(root):
        if not doc.is_file():
            continue
        for target in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: outside links are allowed, just not to files outside the tree
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            where = f"{doc.relative_to(root)}: {target}"
            if not dest.is_relative_to(root.resolve()):
                broken.append(f"{where} points outside the repository")
            elif not dest.exists():
                broken.append(f"{where} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading with anchor #{anchor}")
    return broken


def test_every_link_in_the_docs_resolves() -> None:
    broken = broken_links(ROOT)
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## 2. Two (`x`)\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#2-two-x) [ok](#top) [web](https://example.com)\n"
        "[gone](docs/b.md) [out](../shared/DESIGN.md) [anchor](docs/a.md#three)\n\n# Top\n")
    assert [b.split(": ", 1)[1] for b in broken_links(tmp_path)] == [
        "docs/b.md does not exist", "../shared/DESIGN.md points outside the repository",
        "docs/a.md#three: no heading with anchor #three"]
