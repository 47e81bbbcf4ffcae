"""The README and docs/ hold together: links resolve, named records exist, the words stay the project's.

A records file is named either by its path (`docs/results/...`, `docs/img/...`, globs allowed) or by its bare
file name in prose; a bare name must exist under docs/results/ or docs/img/ unless it is one of the names a
run or a user writes (`GENERIC`: results.jsonl, report.html, a user's own file in an example).

Checked against the files themselves and GitHub's own rules for heading anchors (lower case;
everything but letters, digits, spaces, hyphens and underscores dropped; spaces become hyphens;
a repeated heading gets `-1`, `-2`, ...), not against any code of kvevict.

Words the docs must not use: the documents speak of the project (what it does, how to use it,
what it found), never of how its work was organised. "session", "issue", "helper", "worktree"
and a local path (`/work/`, `/home/`) are banned as whole words in any form. "round" is banned
too, except where it is the English of the thing itself: "round trip" / "round-trip" (a record
read back unchanged), "rounded" / "rounding" (arithmetic) and the `--rounds` option of the
benchmark scripts (how many times the arms take turns).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the pages a user reads, and the experiment logs kept beside their records (docs/results/*-log.md)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
RECORDS = re.compile(r"docs/(?:results|img)/[A-Za-z0-9_.*\-]+[A-Za-z0-9*]")
# a bare file name in prose: a records file (under docs/results/ or docs/img/) unless it is a name a run or a
# user writes, listed here
BARE = re.compile(r"(?<![/\w.-])([A-Za-z0-9_][\w.-]*\.(?:jsonl|json|txt|html|png))\b")
GENERIC = {"results.jsonl", "run.json", "report.html", "config.json", "FILE.jsonl", "qa.jsonl", "my.txt", "my-logs.txt",
           "my-questions.jsonl", "sinks.png", "controls.txt", "kvevict.report.html", "policy.json", "audit.json"}
BANNED = re.compile(r"\b(sessions?|issues?|helpers?|worktrees?|rounds?)\b|/work/|/home/", re.IGNORECASE)
ALLOWED_ROUND = re.compile(r"round[- ]trip|--rounds\b", re.IGNORECASE)


def prose_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, line, inside a fenced code block) for every line of a Markdown text."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            out.append((number, line, True))
            continue
        out.append((number, line, fenced))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (inline code, emphasis and link targets as GitHub renders them)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line, fenced in prose_lines(path.read_text()):
        match = None if fenced else HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """Every Markdown link target outside code, with its line."""
    found = []
    for number, line, fenced in prose_lines(path.read_text()):
        if fenced:
            continue
        prose = re.sub(r"`[^`]*`", "", line)  # a link written inside inline code is not a link
        found += [(number, m.group(1)) for m in LINK.finditer(prose)]
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: — not checked offline
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_records_file_named_exists(path):
    missing = []
    for number, line, _ in prose_lines(path.read_text()):
        named = RECORDS.findall(line) + [
            f"docs/*/{bare}" for bare in BARE.findall(line) if bare not in GENERIC and "*" not in bare
        ]
        for name in named:
            if not list(ROOT.glob(name)):
                missing.append(f"{path.relative_to(ROOT)}:{number}: {name} (no such records file; a name a run or a "
                               "user writes goes in GENERIC)")
    assert missing == []


def banned_words(text: str) -> list[str]:
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in BANNED.finditer(ALLOWED_ROUND.sub("", line)):
            hits.append(f"{number}: {match.group(0)!r} in {line.strip()[:100]}")
    return hits


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_the_project(path):
    assert banned_words(path.read_text()) == []


def test_doc_file_names_speak_of_the_project():
    names = [p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*")]
    assert [n for n in names if BANNED.search(n.replace("-", " ").replace("_", " "))] == []


# --- the checks themselves, on hand-written cases -------------------------------------------------


def test_slug_follows_githubs_rules():
    assert slug("`multi --form aware-requests`: the first question") == "multi---form-aware-requests-the-first-question"
    ruler = "RULER's long-context tasks, offline (`kvevict ruler`)"
    assert slug(ruler) == "rulers-long-context-tasks-offline-kvevict-ruler"
    assert slug("Gemma 3 at 1K–8K: 50%") == "gemma-3-at-1k8k-50"
    assert slug("See [the guide](guide.md) now") == "see-the-guide-now"


def test_a_broken_link_and_a_banned_word_are_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# Title\n\n## Same\n\n## Same\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#same-1) [gone](b.md#same-2) [none](c.md)\n```\n[code](x.md)\n```\n")
    assert broken_links(doc) == ["a.md:1: b.md#same-2 (no heading with that anchor in b.md)",
                                 "a.md:1: c.md (no such file)"]
    assert banned_words("a round trip, --rounds 2, rounded down") == []
    assert [h.split(":")[0] for h in banned_words("ok\nthe third round\nsee /work/x\nIssue 3")] == ["2", "3", "4"]


# --- what the docs and the error messages tell a user to call ----------------------------------------------

CALL = re.compile(r"\bkvevict\.([A-Za-z_]\w*)\(")
SOURCES = [*DOCS, *sorted((ROOT / "src" / "kvevict").rglob("*.py"))]


def called_names(text: str) -> set[str]:
    """The names a text calls as `kvevict.NAME(...)`: what a user would type after `import kvevict`."""
    return set(CALL.findall(text))


def test_every_kvevict_call_named_to_a_user_exists():
    """A doc or an error message that says `kvevict.compress(...)` names a function of the package itself: checked
    by importing kvevict and looking the name up, not against any list of kvevict's."""
    import kvevict

    named = {(p.relative_to(ROOT).as_posix(), n) for p in SOURCES for n in called_names(p.read_text())}
    assert named, "no kvevict.NAME( call found: the pattern no longer matches the docs"
    assert sorted((where, n) for where, n in named if not callable(getattr(kvevict, n, None))) == []


def test_a_call_is_read_from_prose_and_code():
    assert called_names("run `kvevict.compress(model, ids)` or kvevict.load_model(x); kvevict.eval.forward") == {
        "compress", "load_model"}
