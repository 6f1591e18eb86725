"""Run a function on N spawned processes with ``torch.distributed`` initialized, never hanging.

:func:`run_ranks` is what the DCP demo, the multi-process tests and the benchmarks use: spawn
(not fork), a ``file://`` rendezvous in a fresh temporary folder (no fixed port), a short
process-group timeout, and a parent that watches every child. The first rank that raises (or
dies) ends all the others within a second or so, and the parent raises
:class:`RankFailedError` with that rank's traceback; a job past ``timeout_s`` is ended the
same way with a :class:`TimeoutError`.

On CUDA each rank gets GPU ``rank`` and NCCL; NVLink multicast stays off in every child
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).
Gloo talks over the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise (every
rank is on this host).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""Set in every child (and in the parent before spawning): NVLink multicast off."""

_GRACE_S = 1.0  # after a first failure, how long to collect the other ranks' errors
_JOIN_S = 5.0  # how long a terminated child gets before it is killed


class RankFailedError(RuntimeError):
    """A rank raised or died; ``rank`` is the first to fail, ``tracebacks`` maps rank -> text."""

    def __init__(self, world_size: int, tracebacks: dict[int, str]) -> None:
        self.rank = next(iter(tracebacks))
        self.world_size = world_size
        self.tracebacks = dict(tracebacks)
        parts = [f"rank {r} of {world_size} failed:\n{tb.rstrip()}" for r, tb in tracebacks.items()]
        super().__init__("\n\n".join(parts))


def default_backend(device: str) -> str:
    """``"nccl"`` for ``device="cuda"``, else ``"gloo"``."""
    return "nccl" if device == "cuda" else "gloo"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    device: str = "cpu",
    backend: str | None = None,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    num_threads: int | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; gather results.

    Parameters
    ----------
    fn : callable
        A module-level function (spawn pickles it by name). It runs with the default process
        group initialized (``world_size`` ranks); on CUDA, ``torch.cuda.current_device()`` is
        ``rank``. Its return value must pickle.
    world_size : int
        Number of processes (ranks), at least 1.
    args : sequence
        Extra positional arguments (pickled to every child).
    device : {"cpu", "cuda"}
        ``"cuda"``: one GPU per rank (``world_size`` GPUs must be visible).
    backend : str or None
        Process-group backend; default ``"nccl"`` on CUDA, ``"gloo"`` on the CPU.
    timeout_s : float
        Wall-clock limit of the whole job; past it every child is ended.
    pg_timeout_s : float
        The process group's timeout (a collective waiting on a dead peer fails after it).
    num_threads : int or None
        ``torch.set_num_threads`` in each child; default: the CPU count shared among ranks.

    Returns
    -------
    list
        ``fn``'s return value of each rank, in rank order.

    Raises
    ------
    RankFailedError
        A rank raised or exited without a result; names the rank and carries its traceback.
    TimeoutError
        The job ran past ``timeout_s``; names the ranks that had not finished.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if timeout_s <= 0 or pg_timeout_s <= 0:
        raise ValueError(f"timeout_s and pg_timeout_s must be > 0, got {timeout_s}, {pg_timeout_s}")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"world_size={world_size} ranks need {world_size} GPUs (one each), "
                f"{torch.cuda.device_count()} visible"
            )
    backend = backend or default_backend(device)
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ.update(MULTICAST_OFF_ENV)  # the children inherit the parent's environment
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="blocktable-rdzv-")
    init_method = f"file://{os.path.join(tmp, 'store')}"
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(rank, world_size, fn, tuple(args), init_method, backend, device,
                      pg_timeout_s, num_threads, writer),
                name=f"blocktable-rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()  # the child holds the only writer: EOF when it dies
            procs.append(proc)
            conns.append(reader)
        return _collect(procs, conns, world_size, timeout_s)
    finally:
        _end_all(procs)
        for conn in conns:
            conn.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(
    procs: list[Any], conns: list[Connection], world_size: int, timeout_s: float
) -> list[Any]:
    """Wait for every rank's result; on the first failure gather errors briefly, then raise."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = set(range(world_size))
    fail_deadline: float | None = None
    while pending:
        now = time.monotonic()
        if fail_deadline is not None and now >= fail_deadline:
            break
        if now >= deadline:
            raise TimeoutError(
                f"ranks {sorted(pending)} of {world_size} did not finish within "
                f"timeout_s={timeout_s:g} s; every rank was ended"
            )
        limit = min(deadline, fail_deadline or deadline) - now
        waitables: list[Any] = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        for obj in wait(waitables, timeout=limit):
            rank = _rank_of(obj, procs, conns)
            if rank not in pending:
                continue
            ok, payload = _receive(rank, procs[rank], conns[rank])
            if ok is None:
                continue  # the pipe is still open: the message comes next round
            pending.discard(rank)
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
                if fail_deadline is None:
                    fail_deadline = time.monotonic() + _GRACE_S
    if failures:
        raise RankFailedError(world_size, failures)
    return [results[r] for r in range(world_size)]


def _rank_of(obj: object, procs: list[Any], conns: list[Connection]) -> int:
    for r, (proc, conn) in enumerate(zip(procs, conns)):
        if obj is conn or obj == proc.sentinel:
            return r
    raise AssertionError(f"unknown waitable {obj!r}")  # pragma: no cover


def _receive(rank: int, proc: Any, conn: Connection) -> tuple[bool | None, Any]:
    """``(True, result)``, ``(False, traceback)``, or ``(None, None)`` if nothing is there yet."""
    why = "without a result"
    if conn.poll():
        try:
            return pickle.loads(conn.recv_bytes())  # type: ignore[no-any-return]
        except (EOFError, OSError) as err:  # the child died before (or while) sending
            why = f"without a result ({type(err).__name__}: {err})"
    elif proc.is_alive():
        return None, None
    proc.join(_JOIN_S)
    return False, f"the process exited with code {proc.exitcode} {why}"


def _end_all(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + _JOIN_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(_JOIN_S)


def _child(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    init_method: str,
    backend: str,
    device: str,
    pg_timeout_s: float,
    num_threads: int,
    conn: Connection,
) -> None:
    os.environ.update(MULTICAST_OFF_ENV)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the DNS
    initialized = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(num_threads)
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=init_method, world_size=world_size, rank=rank,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        initialized = True
        result = fn(rank, world_size, *args)
        # Plain pickle: multiprocessing's pickler would pass tensors as shared memory that
        # vanishes with this process.
        conn.send_bytes(pickle.dumps((True, result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        try:
            conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
        except Exception:  # noqa: BLE001 - e.g. a result that does not pickle
            conn.send_bytes(pickle.dumps(
                (False, "could not send the rank's error:\n" + traceback.format_exc())
            ))
        initialized = False  # peers may be gone: tearing the group down could block
    finally:
        conn.close()
        if initialized:
            import torch.distributed as dist

            dist.destroy_process_group()
