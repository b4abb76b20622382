"""The ``comet`` command: ``comet info | bench | tune [args...]``.

Each subcommand lives in ``comet.cli.<name>`` and is imported only when asked for, so
``comet info`` works on a machine where the benchmark's dependencies are missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand -> one-line help. The module ``comet.cli.<name>`` provides ``main(argv)``.
SUBCOMMANDS: dict[str, str] = {
    "info": "versions, GPUs, peer access and which code path would run",
    "bench": "benchmark the fused layer against the unfused baseline",
    "tune": "tune the comm/compute block split and write a config table",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comet", description="Comet: MoE layers with communication hidden inside "
        "the expert GEMMs.", epilog="Run 'comet <command> --help' for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, text in SUBCOMMANDS.items():
        # The subcommand parses its own arguments: no prefix character is an option here,
        # so everything after the name (including -h) reaches it untouched.
        p = sub.add_parser(name, help=text, add_help=False, prefix_chars="\0")
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; returns its code."""
    try:
        ns = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as e:  # --help or a usage error: argparse already printed why
        return 0 if e.code is None else int(e.code)
    module_name = f"comet.cli.{ns.command}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"comet {ns.command}: not available in this installation "
                  f"({module_name} is missing)", file=sys.stderr)
        else:
            print(f"comet {ns.command}: needs the module {e.name!r}, which is not "
                  f"installed ({e})", file=sys.stderr)
        return 2
    entry = getattr(module, "main", None)
    if not callable(entry):
        print(f"comet {ns.command}: {module_name} has no main(argv)", file=sys.stderr)
        return 2
    code = entry(ns.args)
    return 0 if code is None else int(code)


if __name__ == "__main__":
    raise SystemExit(main())
