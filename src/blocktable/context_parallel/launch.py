"""Run a function on N spawned processes with ``torch.distributed`` initialized, never hanging.

:func:`run_ranks` is what the DCP demo, the multi-process tests and the benchmarks use: spawn
(not fork), a rendezvous on a ``TCPStore`` that the parent serves on a free loopback port (no
file is ever written), a short process-group timeout, and a parent that watches every child.

- The first rank that raises, dies or stalls ends all the others within a second or so, and
  the parent raises :class:`RankFailedError` naming the rank to blame first: one that died
  (with its signal, ``SIGKILL``, ``SIGABRT``...), else one that stalled (no answer while the
  others failed), else one that raised, before the ranks that only failed waiting on it; with
  the last step each rank finished (see :func:`report_step`). A job past ``timeout_s`` is
  ended the same way with a :class:`TimeoutError`.
- The ranks live no longer than the parent: on Linux the kernel kills a rank whose parent
  dies (``PR_SET_PDEATHSIG``), and everywhere a thread in each rank watches a pipe that only
  the parent holds open.
- SIGINT (Ctrl-C) and SIGTERM reach the parent only (the ranks start with SIGINT blocked, so
  a terminal's Ctrl-C passes them by); the parent ends every rank and raises
  :class:`Interrupted`, whose ``exit_code`` is 130 or 143.

On CUDA each rank gets GPU ``rank`` and NCCL; NVLink multicast stays off in every child
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).
Gloo talks over the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise (every
rank is on this host).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
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
_PR_SET_PDEATHSIG = 1
# What a rank raises when a peer died or stalled: it only waited (gloo's words).
_WAITED = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
           "timed out", "Broken pipe")

_progress: tuple[Any, int] | None = None  # in a rank: (the shared step array, this rank)


def report_step(step: int) -> None:
    """Record that this rank finished ``step`` (a cheap store into memory the parent reads).

    The engine calls it after each step; the parent names each rank's last finished step
    when a rank fails. Does nothing outside :func:`run_ranks`.
    """
    if _progress is not None:
        steps, rank = _progress
        steps[rank] = step


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the parent of the ranks; every rank has been ended.

    Attributes
    ----------
    signum : int
        The signal.
    exit_code : int
        ``128 + signum``: 130 for SIGINT, 143 for SIGTERM, as a shell reports them.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: every rank was ended")


class RankFailedError(RuntimeError):
    """A rank raised, died or stalled.

    Attributes
    ----------
    rank : int
        The rank to blame first (died, else stalled, else raised, before those that only
        failed waiting on a peer).
    world_size : int
    tracebacks : dict
        rank -> what went wrong there (its traceback, or how the process ended), blamed first.
    cause : str
        ``"died"``, ``"stalled"`` or ``"raised"``: what :attr:`rank` did.
    signal_name : str or None
        The signal that killed :attr:`rank` (``"SIGKILL"``...), if one did.
    last_steps : list of int or None
        Per rank, the last step it finished (-1: none), when the ranks reported steps.
    """

    def __init__(
        self,
        world_size: int,
        tracebacks: dict[int, str],
        *,
        cause: str = "raised",
        signal_name: str | None = None,
        exit_code: int | None = None,
        last_steps: list[int] | None = None,
    ) -> None:
        self.rank = next(iter(tracebacks))
        self.world_size = world_size
        self.tracebacks = dict(tracebacks)
        self.cause, self.signal_name, self.last_steps = cause, signal_name, last_steps
        r = self.rank
        if cause == "died":
            how = (f"died: killed by {signal_name} (exit code {exit_code})" if signal_name
                   else f"died: exited with code {exit_code} without a result")
        elif cause == "stalled":
            how = f"stalled: no result and no error {_GRACE_S:g} s after another rank failed"
        else:
            lines = [ln for ln in tracebacks[r].strip().splitlines() if ln.strip()]
            how = f"raised {lines[-1].strip() if lines else 'an error'}"
        summary = f"rank {r} of {world_size} {how}"
        if last_steps is not None:
            step = last_steps[r]
            summary += ("; it finished no step" if step < 0
                        else f"; the last step it finished: {step}")
            others = [f"rank {q}: {s}" for q, s in enumerate(last_steps) if q != r]
            summary += f" (others: {', '.join(others)})" if others else ""
        self.summary = summary
        parts = [f"rank {q} of {world_size} failed:\n{tb.rstrip()}" for q, tb in tracebacks.items()]
        super().__init__("\n\n".join([summary, *parts]))


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
        A rank raised, died or stalled; names the rank to blame and carries every failure.
    TimeoutError
        The job ran past ``timeout_s``; names the ranks that had not finished.
    Interrupted
        SIGINT or SIGTERM reached this process (when it calls from the main thread, where
        signal handlers live); every rank was ended first.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if timeout_s <= 0 or pg_timeout_s <= 0:
        raise ValueError(f"timeout_s and pg_timeout_s must be > 0, got {timeout_s}, {pg_timeout_s}")
    import torch
    import torch.distributed as dist

    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"world_size={world_size} ranks need {world_size} GPUs (one each), "
            f"{torch.cuda.device_count()} visible"
        )
    backend = backend or default_backend(device)
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ.update(MULTICAST_OFF_ENV)  # the children inherit the parent's environment
    ctx = mp.get_context("spawn")
    # The parent serves the rendezvous: nothing on disk, and it ends with the parent.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=pg_timeout_s),
                          wait_for_workers=False)
    steps = ctx.Array("q", [-1] * world_size, lock=False)
    procs: list[Any] = []
    conns: list[Connection] = []
    lifelines: list[Connection] = []
    with _signals_raise_interrupted():
        try:
            with _sigint_held():  # inherited: Ctrl-C at a terminal reaches the parent only
                for rank in range(world_size):
                    reader, writer = ctx.Pipe(duplex=False)
                    life_reader, life_writer = ctx.Pipe(duplex=False)
                    proc = ctx.Process(
                        target=_child,
                        args=(rank, world_size, fn, tuple(args), store.port, backend, device,
                              pg_timeout_s, num_threads, writer, life_reader, os.getpid(),
                              steps),
                        name=f"blocktable-rank{rank}",
                        daemon=True,
                    )
                    proc.start()
                    writer.close()  # the child holds the only writer: EOF when it dies
                    life_reader.close()  # the child holds the only reader: EOF when we die
                    procs.append(proc)
                    conns.append(reader)
                    lifelines.append(life_writer)
            return _collect(procs, conns, world_size, timeout_s, steps)
        finally:
            with _ignoring(signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C: still clean up
                _end_all(procs)
                for conn in (*conns, *lifelines):
                    conn.close()
                del store


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _signals_raise_interrupted() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` here (main thread only)."""
    if not _in_main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _ignoring(*signums: int) -> Iterator[None]:
    if not _in_main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signums}
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Start children with SIGINT blocked (the mask survives exec; Python leaves it so), and
    deliver a SIGINT that arrived meanwhile to this process afterwards, not lose it."""
    if not hasattr(signal, "pthread_sigmask"):  # no signal masks: ignore it while starting
        with _ignoring(signal.SIGINT):
            yield
        return
    # Starting multiprocessing's resource tracker unblocks SIGINT when it is done: start it
    # first, so that it is already running when the ranks start.
    with contextlib.suppress(ImportError, AttributeError):
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _collect(
    procs: list[Any], conns: list[Connection], world_size: int, timeout_s: float, steps: Any
) -> list[Any]:
    """Wait for every rank's result; on the first failure gather errors briefly, then raise."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    failures: dict[int, tuple[str, str]] = {}  # rank -> (cause, text)
    pending = set(range(world_size))
    fail_deadline: float | None = None
    while pending:
        now = time.monotonic()
        if fail_deadline is not None and now >= fail_deadline:
            for rank in sorted(pending):  # alive, silent while a peer failed
                failures[rank] = ("stalled", (
                    "the process was still running, with no result and no error, "
                    f"{_GRACE_S:g} s after another rank failed"))
            break
        if now >= deadline:
            last = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps[:]))
            raise TimeoutError(
                f"ranks {sorted(pending)} of {world_size} did not finish within "
                f"timeout_s={timeout_s:g} s; every rank was ended (last finished steps: {last})"
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
        raise _blame(world_size, failures, procs, steps[:])
    return [results[r] for r in range(world_size)]


def _blame(
    world_size: int, failures: dict[int, tuple[str, str]], procs: list[Any], steps: list[int]
) -> RankFailedError:
    """Order the failures, the rank to blame first: died, stalled, raised, only waited."""

    def order(rank: int) -> int:
        cause, text = failures[rank]
        if cause == "raised" and any(w in text for w in _WAITED):
            return 3
        return {"died": 0, "stalled": 1, "raised": 2}[cause]

    ranks = sorted(failures, key=order)  # stable: the first seen first among equals
    first = ranks[0]
    cause = failures[first][0]
    code = procs[first].exitcode
    name = _signal_name(code) if cause == "died" else None
    return RankFailedError(
        world_size, {r: failures[r][1] for r in ranks}, cause=cause, signal_name=name,
        exit_code=code, last_steps=steps if max(steps) >= 0 else None,
    )


def _signal_name(exit_code: int | None) -> str | None:
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def _rank_of(obj: object, procs: list[Any], conns: list[Connection]) -> int:
    for r, (proc, conn) in enumerate(zip(procs, conns)):
        if obj is conn or obj == proc.sentinel:
            return r
    raise AssertionError(f"unknown waitable {obj!r}")  # pragma: no cover


def _receive(rank: int, proc: Any, conn: Connection) -> tuple[bool | None, Any]:
    """``(True, result)``, ``(False, (cause, text))``, or ``(None, None)`` if nothing is there
    yet."""
    why = "without a result"
    if conn.poll():
        try:
            ok, payload = pickle.loads(conn.recv_bytes())
            return (True, payload) if ok else (False, ("raised", payload))
        except (EOFError, OSError) as err:  # the child died before (or while) sending
            why = f"without a result ({type(err).__name__}: {err})"
    elif proc.is_alive():
        return None, None
    proc.join(_JOIN_S)
    code = proc.exitcode
    name = _signal_name(code)
    how = (f"the process was killed by {name} (exit code {code})" if name
           else f"the process exited with code {code}")
    return False, ("died", f"{how} {why}")


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


def _die_with_parent(parent_pid: int, lifeline: Connection) -> None:
    """End this process when the parent ends: PR_SET_PDEATHSIG on Linux, and a thread that
    waits for the parent's end of ``lifeline`` to close (anywhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):  # no libc prctl: the thread still watches
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            lifeline.recv_bytes()
        os._exit(1)

    threading.Thread(target=watch, name="blocktable-lifeline", daemon=True).start()


def _child(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    store_port: int,
    backend: str,
    device: str,
    pg_timeout_s: float,
    num_threads: int,
    conn: Connection,
    lifeline: Connection,
    parent_pid: int,
    steps: Any,
) -> None:
    global _progress
    _die_with_parent(parent_pid, lifeline)
    _progress = (steps, rank)
    os.environ.update(MULTICAST_OFF_ENV)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the DNS
    initialized = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(num_threads)
        if device == "cuda":
            torch.cuda.set_device(rank)
        timeout = timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout)
        dist.init_process_group(backend, store=store, world_size=world_size, rank=rank,
                                timeout=timeout)
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
