"""Run a function on N processes joined in a gloo group; never hang.

``run_ranks(fn, world_size, tmp_dir)`` starts ``world_size`` processes with the ``forkserver``
start method (each a fork of one server process that imported torch and transformers' Llama
once, instead of a fresh interpreter importing them for seconds per rank) and given the
parent's environment as it is at the start, each initializing a gloo group through a
``file://`` rendezvous in ``tmp_dir`` (no port) with a short collective timeout, then calling
``fn(rank, world_size, *args)``. Each child writes what ``fn`` returns (JSON-able) or its
traceback to a file; the parent waits at most ``timeout_s`` in all, kills every child still
running, and raises naming the ranks that failed, timed out before writing their result, or
died. ``fn`` must be a module-level function (the children import it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, tmp_dir: str, pg_timeout_s: float,
    args: tuple[Any, ...], env: dict[str, str],
) -> None:
    # die with the fork server, which ends when the test process does: never orphaned
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    # the fork server's environment is the one it started with; a test's is the parent's now
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the cores: spinning intra-op threads starve peers

    result_path = Path(tmp_dir) / f"rank{rank}.json"
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{Path(tmp_dir) / 'rendezvous'}", rank=rank,
            world_size=world_size, timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        report = {"ok": True, "value": value}
    except BaseException:  # noqa: BLE001 - reported to the parent
        report = {"ok": False, "error": traceback.format_exc()}
    result_path.write_text(json.dumps(report))
    with contextlib.suppress(Exception):  # a dead peer may fail teardown; the result is written
        if dist.is_initialized():
            dist.destroy_process_group()


# What every rank imports, imported once in the fork server (a missing one is skipped there).
_PRELOAD = ["torch", "torch.distributed", "numpy", "transformers.models.llama.modeling_llama"]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_dir: str | os.PathLike[str],
    *,
    args: tuple[Any, ...] = (),
    timeout_s: float = 60.0,
    pg_timeout_s: float = 10.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return the
    values by rank, or raise ``AssertionError`` with every failing rank's error."""
    tmp = Path(tmp_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    # The children work on CPU tensors: Triton runs there under its interpreter, which must be
    # chosen before triton is imported. Unpickling ``fn`` imports it before ``_child`` runs,
    # under the fork server's environment: the server starts below, on first use, with it set.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, str(tmp), pg_timeout_s, args, env),
                    daemon=True)
        for r in range(world_size)
    ]
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    # A rank whose result is written but which is still running hangs in the group's
    # teardown (torch's gloo teardown can deadlock while a collective's work is released):
    # it is killed, and its result stands.
    timed_out = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in timed_out:
        procs[r].kill()
        procs[r].join(5.0)
    values, errors = [], []
    for r in range(world_size):
        path = tmp / f"rank{r}.json"
        if r in timed_out and not path.exists():
            errors.append(f"rank {r}: still running after {timeout_s} s, killed")
        elif not path.exists():
            errors.append(f"rank {r}: died (exit code {procs[r].exitcode}) without a result")
        else:
            report = json.loads(path.read_text())
            if not report["ok"]:
                errors.append(f"rank {r}:\n{report['error']}")
            values.append(report.get("value"))
    if errors:
        raise AssertionError("\n".join(errors))
    return values
