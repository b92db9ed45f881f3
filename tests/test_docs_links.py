"""Every relative link in the repository's Markdown resolves (a CPU test), and docs/ keeps
its own rules: docs/results/ holds only raw data a current page cites, and the pages state
figures, not an issue's targets.

For each *.md (not under .git, cache/, .peers/, .carry/ or docs/results/, whose files are
recorded output), every inline link or image [text](target), [text](target#anchor) or
(#anchor), and every reference definition [label]: target, must name a path that exists
relative to the file (a leading / is the repository root), and an anchor into a Markdown
file must be the slug of one of its headings as GitHub makes it: lowercase, characters
other than letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens,
the second heading of a slug suffixed -1, the third -2 and so on. Links with a scheme
(http:, https:, mailto:) and anything inside code (fenced blocks, `spans`) are skipped.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".peers", ".carry", ".pytest_cache", "__pycache__", "node_modules"}
SKIP_PATHS = {"cache", "docs/results"}  # relative to the repository root

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK_TEXT = r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]"
INLINE_LINK = re.compile(r"!?" + LINK_TEXT + r"\(\s*(<[^>]*>|[^\s()]*)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def markdown_files(root: Path = REPO) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                         and (rel / d).as_posix() not in SKIP_PATHS)
        found += [Path(folder) / f for f in sorted(files) if f.endswith(".md")]
    return found


def prose_lines(text: str, blank_code: bool = True):
    """(line number, line) outside fenced code blocks, inline code spans blanked out
    (kept with blank_code=False: a heading's anchor keeps its code spans' text)."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
                fence = None
        else:
            yield number, CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line) if blank_code else line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before the -N suffix of duplicates)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)             # code spans: their text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                     # inline HTML
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)          # _emphasis_ (snake_case stays)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a Markdown text offers: its headings' slugs, duplicates numbered, and
    explicit <a name=...> / id=... targets."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    previous = ""
    for _, line in prose_lines(text, blank_code=False):
        found.update(HTML_ANCHOR.findall(CODE_SPAN.sub("", line)))
        heading = None
        m = ATX_HEADING.match(line)
        if m:
            heading = m.group(2) or ""
        elif previous.strip() and SETEXT_UNDERLINE.match(line) and not ATX_HEADING.match(previous):
            heading = previous.strip()
        previous = "" if heading is not None else line
        if heading is None:
            continue
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str):
    """(line number, target) of every link in the prose of a Markdown text."""
    for number, line in prose_lines(text):
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)]
        m = REFERENCE_DEF.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            yield number, target.strip("<>")


def _shown(path: Path, root: Path) -> str:
    return Path(os.path.relpath(path, root)).as_posix()


def broken_links(md: Path, root: Path = REPO, cache: dict | None = None) -> list[str]:
    """'file:line: target: why' for each link of md that does not resolve."""
    cache = {} if cache is None else cache
    problems = []
    for number, target in links(md.read_text(encoding="utf-8")):
        if not target or SCHEME.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            dest = md
        elif path_part.startswith("/"):
            dest = root / path_part.lstrip("/")
        else:
            dest = md.parent / path_part
        where = f"{md.relative_to(root).as_posix()}:{number}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no such file {_shown(dest, root)}")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md":
            key = dest.resolve()
            if key not in cache:
                cache[key] = anchors(dest.read_text(encoding="utf-8"))
            if unquote(anchor) not in cache[key]:
                problems.append(f"{where}: no heading #{anchor} in {_shown(dest, root)}")
    return problems


# --- the checker's own rules ---------------------------------------------------------------
def test_slug_follows_github():
    assert slug("How we measure") == "how-we-measure"
    assert slug("KV-cache ops (append, flatten)") == "kv-cache-ops-append-flatten"
    assert slug("`plan()` and `run()`: host cost") == "plan-and-run-host-cost"
    assert slug("b=1 kv=32k — 47.0 µs") == "b1-kv32k--470-µs"
    assert slug("_FULL_GRID_MIN_TENTHS in **decode.py**") == "full_grid_min_tenths-in-decodepy"
    assert slug("See [the page](other.md#x)") == "see-the-page"


def test_duplicate_headings_are_numbered_and_code_is_not_a_heading():
    text = "# Decode\n\n## Runs\n\n```\n# not a heading\n```\n\n## Runs\n\nSetext\n------\n\n## Runs\n"
    assert anchors(text) == {"decode", "runs", "runs-1", "runs-2", "setext"}


def test_a_headings_code_spans_keep_their_text_in_its_anchor():
    text = "# Batch prefill\n\n## Status at `497f941`, as the page opened\n\n## `plan()` and `run()`\n"
    assert anchors(text) == {"batch-prefill", "status-at-497f941-as-the-page-opened", "plan-and-run"}


def test_broken_links_are_listed_with_file_and_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Plan rules\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md#plan-rules) [ok](#top) [web](https://example.com/x.md)\n"
        "# Top\n"
        "[gone](docs/missing.md)\n"
        "`[code](docs/missing.md)`\n"
        "```\n[fenced](docs/missing.md)\n```\n"
        "[bad anchor](docs/page.md#plan) ![figure](docs/fig.png)\n"
        "[self](#nowhere)\n"
        "[ref]: docs/also-missing.md\n")
    found = broken_links(tmp_path / "README.md", tmp_path)
    assert [p.split(": (")[0] for p in found] == ["README.md:3", "README.md:8", "README.md:8", "README.md:9",
                                                 "README.md:10"]
    assert "no heading #plan in docs/page.md" in found[1]
    assert "no such file docs/fig.png" in found[2]


def test_markdown_files_skip_recorded_results_and_carried_copies(tmp_path):
    for rel in ("README.md", "docs/a.md", "docs/results/r.md", "cache/c.md", ".peers/p.md", "x/.carry/q.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("# x\n")
    assert [p.relative_to(tmp_path).as_posix() for p in markdown_files(tmp_path)] == ["README.md", "docs/a.md"]


# --- the repository ------------------------------------------------------------------------
def test_every_relative_link_in_the_markdown_resolves():
    files = markdown_files()
    assert any(f.name == "README.md" for f in files)
    cache: dict = {}
    problems = [p for md in files for p in broken_links(md, REPO, cache)]
    assert not problems, f"{len(problems)} broken link(s) in the Markdown:\n" + "\n".join(problems)


def current_pages(root: Path = REPO) -> list[Path]:
    """The pages a user reads today: README.md and docs/*.md (not docs/history/, the logs)."""
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def test_the_check_covers_readme_docs_and_history():
    checked = {f.relative_to(REPO).as_posix() for f in markdown_files()}
    expected = {"README.md"} | {f.relative_to(REPO).as_posix() for f in (REPO / "docs").glob("*.md")} \
        | {f.relative_to(REPO).as_posix() for f in (REPO / "docs" / "history").glob("*.md")}
    assert expected <= checked, f"not checked: {sorted(expected - checked)}"
    assert {"docs/architecture.md", "docs/prefill.md", "docs/history/README.md",
            "docs/history/prefill.md", "docs/history/prefill-runs.md"} <= checked


def test_every_raw_result_is_cited_by_a_current_page():
    """docs/results/ keeps what README.md and docs/*.md cite; older runs live in git history
    (docs/history/README.md says how to reach them)."""
    cited = set()
    for page in current_pages():
        cited.update(re.findall(r"results/([A-Za-z0-9_.+-]+)", page.read_text(encoding="utf-8")))
    kept = {f.name for f in (REPO / "docs" / "results").iterdir() if f.is_file()}
    assert not kept - cited, "raw files no current page cites (git rm them; git history keeps them):\n" + \
        "\n".join(sorted(kept - cited))


def test_current_pages_state_figures_not_an_issues_target():
    found = [f"{page.relative_to(REPO).as_posix()}:{number}: {line.strip()}"
             for page in current_pages()
             for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"issue'?s?'? targets?|targets? of the issue|issue target", line, re.I)]
    assert not found, "\n".join(found)
