"""What every results file records about the code and machine that produced it, and the
one writer every results file goes through.

The four fields every file written from now on carries (:data:`FIELDS`): ``device`` (the
GPU's name, ``cpu`` without one), ``commit``, ``kernels``
(:func:`comet.constants.kernel_identity`, a hash of the kernel sources) and ``command``;
beside them the torch and Triton versions. Files written before 2026-12-04 may lack some
and hold a hand-kept ``kernel_revision`` instead of ``kernels``
(:func:`comet.constants.kernels_of` reads both).

The commit is ``$COMET_COMMIT`` when set -- the device machines get a copy of the tree
whose git state need not be the commit that was sent, so their launch scripts pass the
real one -- else what ``git describe --always --dirty`` says of the package's checkout,
else ``"unknown"``.

Paths in a written file are repo-relative: a file is read on other machines, where the
writer's checkout, ``/tmp`` or home folder mean nothing (:func:`repo_relative`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch
import triton

from comet.constants import kernel_identity, kernels_of

#: The provenance every results file carries (as top-level keys, or in each record).
FIELDS = ("device", "commit", "kernels", "command")

#: The checkout the package runs from: paths under it are written relative to it.
REPO_ROOT = Path(__file__).resolve().parent.parent.parent

#: An absolute path: ``/`` then at least two components, not inside a word or a relative
#: path (``tokens/s``, ``a/b`` are left alone).
_ABSOLUTE = re.compile(r"(?<![\w./~-])/(?:[\w.+=,@-]+/)+[\w.+=,@-]*")


@lru_cache(maxsize=1)
def commit() -> str:
    if os.environ.get("COMET_COMMIT"):
        return os.environ["COMET_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"],
                             cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def device_name() -> str:
    """The current CUDA device's name, ``cpu`` without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def command_line(argv: list[str] | None = None) -> str:
    """The command that runs (``sys.argv`` by default), shell-quoted, paths repo-relative."""
    return repo_relative(shlex.join(sys.argv if argv is None else argv))


def provenance(command: str | None = None, device: str | None = None) -> dict:
    """``{device, commit, kernels, command, torch, triton}`` for a results file's metadata
    (``command``: default the running one, :func:`command_line`; ``device``: default
    :func:`device_name`)."""
    return {"device": device or device_name(), "commit": commit(),
            "kernels": kernel_identity(),
            "command": repo_relative(command) if command else command_line(),
            "torch": torch.__version__, "triton": triton.__version__}


def _relative_one(match: re.Match) -> str:
    path = match.group(0)
    root = str(REPO_ROOT) + "/"
    if path.startswith(root):
        return path[len(root):] or "."
    cwd = os.getcwd().rstrip("/") + "/"
    if path.startswith(cwd) and cwd != "/":
        return path[len(cwd):] or "."
    return Path(path).name or "."   # outside the checkout (/tmp/...): its name alone


def repo_relative(text: str) -> str:
    """``text`` with every absolute path in it made relative to the checkout (or the
    working folder); a path outside both keeps only its last component."""
    return _ABSOLUTE.sub(_relative_one, text)


def _relative_all(data):
    if isinstance(data, str):
        return repo_relative(data)
    if isinstance(data, dict):
        return {_relative_all(k): _relative_all(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_relative_all(v) for v in data]
    return data


def absolute_paths(data) -> list[str]:
    """Every absolute path in the strings of ``data`` (what :func:`write_result` removes)."""
    if isinstance(data, str):
        return _ABSOLUTE.findall(data)
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in absolute_paths(k) + absolute_paths(v)]
    if isinstance(data, (list, tuple)):
        return [p for v in data for p in absolute_paths(v)]
    return []


def missing_fields(data) -> list[str]:
    """The :data:`FIELDS` a results file's data lacks (for a list of records: any record);
    a file with ``kernel_revision`` only lacks ``kernels``."""
    parts = data if isinstance(data, list) else [data]
    return sorted({f for d in parts for f in FIELDS
                   if not isinstance(d, dict) or d.get(f) in (None, "")})


def write_result(path: str | os.PathLike, data, *, command: str | None = None,
                 device: str | None = None, indent: int | None = 1) -> str:
    """Write a results file: ``data`` (a dict, or a list of record dicts) with the
    :func:`provenance` fields it lacks filled in (top-level, or in every record; those
    it has are kept: a record made on rank 0 knows its device), every path in it made
    repo-relative. Returns ``path``."""
    stamp = provenance(command, device)
    if isinstance(data, dict):
        data = {**stamp, **data}
    elif isinstance(data, list):
        data = [{**stamp, **r} if isinstance(r, dict) else r for r in data]
    else:
        raise TypeError(f"a results file holds a dict or a list of records, got "
                        f"{type(data).__name__}")
    data = _relative_all(data)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
        f.write("\n")
    return str(path)


__all__ = ["FIELDS", "absolute_paths", "command_line", "commit", "device_name",
           "kernels_of", "missing_fields", "provenance", "repo_relative", "write_result"]
