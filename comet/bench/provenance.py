"""What every results file records about the code that produced it, so that a number can
be traced to its kernels: the commit, the kernel revision, and the versions around them.

The commit is ``$COMET_COMMIT`` when set -- the device machines get a copy of the tree
whose git state need not be the commit that was sent, so their launch scripts pass the
real one -- else what ``git describe --always --dirty`` says of the package's checkout,
else ``"unknown"``.
"""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from pathlib import Path

import torch
import triton

from comet.constants import KERNEL_REVISION


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


def provenance() -> dict:
    """``{commit, kernel_revision, torch, triton}`` for a results file's metadata."""
    return {"commit": commit(), "kernel_revision": KERNEL_REVISION,
            "torch": torch.__version__, "triton": triton.__version__}
