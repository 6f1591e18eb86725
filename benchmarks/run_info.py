"""What every benchmark's JSON records about its run: commit, date (UTC), machine, versions."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def machine() -> str:
    """Host name, CPU model and the number of CPUs this process may use."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()}, {model}, {len(os.sched_getaffinity(0))} CPUs"


def git_commit() -> str:
    """HEAD of the checkout this file lives in, with ``+dirty`` when files differ from it.

    A copy of the tree without its own history (a remote machine handed the working files)
    names its commit in ``BLOCKTABLE_COMMIT``; the record then says it was given, not read.
    """
    given = os.environ.get("BLOCKTABLE_COMMIT")
    if given:
        return f"{given} (given by BLOCKTABLE_COMMIT)"
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, cwd=here).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def run_info() -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
    }
