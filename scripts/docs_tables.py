"""Regenerate the tables of docs/benchmarks.md from the result files they name.

Each table block sits between two markers; the first holds the ``comet bench`` arguments
that render it (paths relative to the repository root)::

    <!-- tables: comet bench --from-json benchmarks/results/<date>/<file>.json --routing uniform -->
    ...what `comet bench --from-json ... --markdown` prints...
    <!-- end tables -->

usage: python scripts/docs_tables.py [--check] [DOC...]   (default: docs/benchmarks.md)
``--check``: change nothing, exit 1 when a block differs from its files (tests/test_docs.py
runs it), so a table cannot drift from its JSON.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from comet.bench import records as rec  # noqa: E402
from comet.bench import report  # noqa: E402

BLOCK = re.compile(r"(<!-- tables: comet bench (?P<args>[^\n]*?) -->\n)(?P<body>.*?)"
                   r"(<!-- end tables -->)", re.S)


def render(args: str) -> str:
    """What ``comet bench <args> --markdown`` prints (``--from-json`` and ``--routing``)."""
    parser = argparse.ArgumentParser(prog="comet bench")
    parser.add_argument("--from-json", nargs="+", required=True)
    parser.add_argument("--routing", nargs="+", default=None)
    a = parser.parse_args(shlex.split(args))
    files = [(p, [rec.derive(r) for r in rec.read_json(str(ROOT / p))]) for p in a.from_json]
    return report.docs_markdown(files, a.routing)


def regenerate(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("args")) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("docs", nargs="*", default=[str(ROOT / "docs" / "benchmarks.md")])
    args = p.parse_args(argv)
    stale = []
    for doc in map(Path, args.docs):
        text = doc.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(str(doc))
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print(f"tables differ from their result files: {', '.join(stale)} (run python "
              f"scripts/docs_tables.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
