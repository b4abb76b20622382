"""The docs cite result files that are in the tree, and the results tree stays small.

README.md, docs/*.md and benchmarks/results/README.md may cite only files in the tree.
A dated README (benchmarks/results/<date>/README.md) is that day's history: it may name
files removed from the tree since, when it names the commit that still has them
(one of :data:`REMOVED_AT`), which must hold them wherever git can say.
"""

import fnmatch
import functools
import importlib.util
import itertools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: The results tree's budget: the source tree is not the archive (git history is).
MAX_RESULTS_BYTES = 10 * 2**20

#: Commits that still have files removed from benchmarks/results: each removal's parent
#: (2026-12-04: 820e493; 2026-12-08: dd00c18).
REMOVED_AT = ("820e493", "dd00c18")

_END = r"(?:\{[^{}\s]*\}|[^\s)`'\",;\]|<>{}])*(?:\{[^{}\s]*\}|[^\s)`'\",;\]|<>{}.:])"
#: A path under benchmarks/results, or one starting at a date folder (``2026-11-26/x.json``).
_CITED = re.compile(r"benchmarks/results/" + _END + r"|(?<![\w/.-])20\d\d-\d\d-\d\d/" + _END)
#: A file name of a dated README's own folder, in backticks (``h200-x.{json,md}``).
_LOCAL = re.compile(r"`(\w[\w.{},+=-]*\.(?:json|md|log|png|txt|csv|gz|jsonl))`")


def expand(text: str) -> list[str]:
    """Brace expansion, as the shell does it: ``a.{json,md}`` -> ``a.json``, ``a.md``."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", text)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited(text: str, base: Path) -> list[str]:
    """The results paths a doc names (relative to benchmarks/results), brace-expanded;
    ``base``: the doc's folder, for file names cited on their own in a dated README."""
    out = []
    for m in _CITED.finditer(text):
        if text[:m.start()].endswith(tuple(f"{c}:" for c in REMOVED_AT)):
            continue                    # a file removed from the tree, cited at the commit
        path = m.group(0).split("benchmarks/results/")[-1]
        out += expand(path)
    if base != RESULTS and base.parent == RESULTS:
        for m in _LOCAL.finditer(text):
            for name in expand(m.group(1)):
                # a file of one of the day's folders may be named on its own (`tune.log`),
                # and a passage moved here from a page may name another day's file
                found = ([] if (base / name).exists()
                         else sorted(base.rglob(name)) or sorted(RESULTS.glob(f"*/{name}")))
                out.append(found[0].relative_to(RESULTS).as_posix() if found
                           else f"{base.name}/{name}")
    return [p.rstrip("/") for p in out if p.rstrip("/")]


def cited_at_commit(text: str, commit: str = REMOVED_AT[0]) -> list[str]:
    """The results paths a doc cites at ``commit``, one of :data:`REMOVED_AT`
    (``820e493:benchmarks/results/<date>/<file>``), brace-expanded."""
    return [p.rstrip("/") for m in re.finditer(re.escape(commit)
                                               + ":benchmarks/results/(" + _END + ")", text)
            for p in expand(m.group(1))]


def exists(path: str) -> bool:
    return bool(list(RESULTS.glob(path))) if "*" in path else (RESULTS / path).exists()


TOP_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md"]
DATED = sorted(RESULTS.glob("20*/README.md"))


@pytest.mark.parametrize("doc", TOP_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_path_a_doc_cites_is_in_the_tree(doc):
    missing = [p for p in cited(doc.read_text(), doc.parent) if not exists(p)]
    assert not missing, f"{doc.relative_to(ROOT)} cites files not in the tree: {missing}"


@functools.lru_cache(maxsize=None)
def _removed_at_commit(commit: str) -> frozenset[str] | None:
    """Files under benchmarks/results at ``commit``, None without git or it."""
    try:
        out = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit,
                              "benchmarks/results"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return frozenset(line[len("benchmarks/results/"):] for line in out.stdout.splitlines())


def _at_commit(path: str, old: set[str]) -> bool:
    return any(fnmatch.fnmatch(q, path) or q.startswith(path + "/") for q in old)


@pytest.mark.parametrize("doc", TOP_DOCS + DATED, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.parametrize("commit", REMOVED_AT)
def test_a_file_cited_at_the_removal_commit_is_there(doc, commit):
    old = _removed_at_commit(commit)
    if old is None:
        pytest.skip(f"no git history with {commit} here (a shallow clone)")
    gone = [p for p in cited_at_commit(doc.read_text(), commit) if not _at_commit(p, old)]
    assert not gone, f"{doc.relative_to(ROOT)} cites files {commit} lacks: {gone}"


@pytest.mark.parametrize("readme", DATED, ids=lambda p: p.parent.name)
def test_a_dated_readme_names_where_its_removed_files_are(readme):
    text = readme.read_text()
    missing = [p for p in cited(text, readme.parent) if not exists(p)]
    if not missing:
        return
    named = [c for c in REMOVED_AT if c in text]
    assert named, (f"{readme.relative_to(ROOT)} cites files not in the tree and does not "
                   f"name a commit that has them ({REMOVED_AT}): {missing[:5]}")
    trees = [_removed_at_commit(c) for c in named]
    if None not in trees:   # a shallow clone cannot say; a full one must agree
        gone = [p for p in missing if not any(
            _at_commit(p, old) or _at_commit("*/" + p.split("/", 1)[1], old)  # another day's
            for old in trees)]
        assert not gone, f"not at {named} either: {gone[:10]}"


def test_the_results_tree_stays_small():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    assert size <= MAX_RESULTS_BYTES, (
        f"benchmarks/results holds {size / 2**20:.1f} MiB (> {MAX_RESULTS_BYTES / 2**20:.0f}"
        f" MiB): keep the files the docs cite, git rm the rest (history keeps them)")


def test_the_citation_reader_finds_what_docs_write():
    """The forms the docs use: a full path, a date-relative path, a brace group, a link."""
    text = ("see benchmarks/results/2026-11-26/h200x4-bench-ep4.json, "
            "[r](../benchmarks/results/2026-11-23/bench.md) and `2026-12-03/x.{json,log}`.")
    assert cited(text, ROOT / "docs") == [
        "2026-11-26/h200x4-bench-ep4.json", "2026-11-23/bench.md", "2026-12-03/x.json",
        "2026-12-03/x.log"]
    removed = f"`{REMOVED_AT[0]}:benchmarks/results/2026-11-27/h100x4-r26-timeline-*`"
    assert cited(removed, ROOT / "docs") == []
    assert cited_at_commit(removed) == ["2026-11-27/h100x4-r26-timeline-*"]
    day = RESULTS / "2026-12-03"
    assert cited("| `a-r2.json`, `.log`, `...-r3.json` | `b/` | 2.5 us |", day) == [
        "2026-12-03/a-r2.json"]


def _docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables",
                                                  ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_tables_are_those_of_their_files():
    """docs/benchmarks.md's tables are what `comet bench --from-json ... --markdown`
    renders from the files they name (python scripts/docs_tables.py rewrites them)."""
    docs = ROOT / "docs" / "benchmarks.md"
    text = docs.read_text()
    tables = _docs_tables()
    assert tables.BLOCK.search(text), "docs/benchmarks.md has no generated table"
    assert tables.regenerate(text) == text, "run python scripts/docs_tables.py"
    tampered = text.replace("| mixtral | 128 |", "| mixtral | 129 |", 1)
    assert tampered != text and tables.regenerate(tampered) == text


def test_the_pages_stay_short():
    """Current numbers and decisions only: the history is in the dated READMEs."""
    for page in ("benchmarks.md", "notebook.md"):
        lines = (ROOT / "docs" / page).read_text().count("\n")
        assert lines <= 300, f"docs/{page} has {lines} lines (at most 300)"
