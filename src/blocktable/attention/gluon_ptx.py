"""A pass over the Gluon prefill kernel's PTX: Triton's idle-state register moves removed.

Triton (3.6 to 3.9) lowers Gluon's ``warp_specialize`` on Hopper with a dispatch loop in which
warps waiting outside their partition give registers back (``setmaxnreg.dec`` to an idle
budget) and the default warps take them (``setmaxnreg.inc``). ptxas then finds "insufficient
register resources" for the consumers' warpgroup MMA (its message C7512) and waits after every
``wgmma``: a product's sixteen-key steps no longer follow each other in the tensor cores, and
no softmax runs under a product. Without the idle-state moves every warp keeps the launch's
``.maxnreg`` until its partition starts; the loader's decrease then frees exactly what the two
consumers' increases take, and ptxas pipelines the ``wgmma``. (That needs the launch to give
every thread ``.maxnreg`` registers, as ptxas does for a kernel that moves registers: an
increase the pool cannot serve would wait forever. ``tests/test_gluon_compile.py`` checks the
count in the machine code.)

The pass runs inside Triton's compilation, for the one kernel named
:data:`KERNEL_NAME` (Triton's stage hook, chained to any hook already installed; installed
when :mod:`blocktable.attention.gluon_prefill` is imported with Gluon present). PTX of
another shape than expected is left as Triton wrote it: the kernel is then slower, never
wrong. Triton 3.7 and later put the pass in their cache key, and call the hook at each launch
of a kernel through ``kernel[grid]`` (a Python call, once the pass is installed, for every
Triton kernel of the process: a kernel compiled before the hook compiles again at its next
such launch); Triton 3.6 does neither: there a kernel cached without the pass is only slower.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

KERNEL_NAME = "gluon_prefill_kernel"
_MAXNREG = re.compile(r"^\.maxnreg (\d+)\s*$", re.MULTILINE)
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);")
_PASS_KEY = "blocktable.gluon_ptx.strip_idle_register_moves/1"
_installed = False


def strip_idle_register_moves(ptx: str, consumer_regs: int) -> str | None:
    """``ptx`` with only the partitions' own ``setmaxnreg``: the loader's decrease to
    ``3 * maxnreg - 2 * consumer_regs`` and the two consumer warpgroups' increases to
    ``consumer_regs`` (three warpgroups: one loader, two consumers). ``None`` when ``ptx`` has
    no ``.maxnreg`` or not exactly those three moves among its others."""
    match = _MAXNREG.search(ptx)
    if match is None:
        return None
    loader_regs = 3 * int(match.group(1)) - 2 * consumer_regs
    kept = {("inc", consumer_regs): 0, ("dec", loader_regs): 0}
    lines = []
    for line in ptx.split("\n"):
        move = _SETMAXNREG.search(line)
        if move is not None:
            key = (move.group(1), int(move.group(2)))
            if key not in kept:
                continue  # a move of warps waiting outside their partition
            kept[key] += 1
        lines.append(line)
    if kept[("inc", consumer_regs)] != 2 or kept[("dec", loader_regs)] != 1:
        return None
    return "\n".join(lines)


def install(consumer_regs: int) -> None:
    """Make Triton run :func:`strip_idle_register_moves` on :data:`KERNEL_NAME`'s PTX from now
    on (once per process; other kernels pass untouched)."""
    global _installed
    if _installed:
        return
    from triton import knobs

    knobs.runtime.add_stages_inspection_hook = make_hook(
        knobs.runtime.add_stages_inspection_hook, consumer_regs)
    _installed = True


def make_hook(previous: Callable | None, consumer_regs: int) -> Callable:
    """Triton's stage hook running the pass after ``previous`` (the hook installed before, or
    ``None``). Called with no arguments (Triton 3.7 on, at each launch and compilation) it
    returns the cache key's share ``(key, digest)``; with ``(backend, stages, options,
    language, capability)`` it wraps ``stages["ptx"]``."""
    alone = (_PASS_KEY, hashlib.sha256(_PASS_KEY.encode()).hexdigest())

    def hook(*args):
        if not args:
            if previous is None:
                return alone
            key, digest = previous()
            return key + _PASS_KEY, hashlib.sha256((digest + _PASS_KEY).encode()).hexdigest()
        if previous is not None:
            previous(*args)
        stages = args[1]
        make_ptx = stages.get("ptx")
        if make_ptx is None:
            return

        def ptx_stage(src, metadata):
            ptx = make_ptx(src, metadata)
            if metadata.get("name") == KERNEL_NAME:  # (make_ptx names the kernel)
                ptx = strip_idle_register_moves(ptx, consumer_regs) or ptx
            return ptx

        stages["ptx"] = ptx_stage

    return hook
