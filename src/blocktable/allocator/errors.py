"""Exceptions of the block allocator.

Running out of blocks or rows is not a mistake of the caller: a scheduler asks
:meth:`~blocktable.allocator.KVCacheManager.can_allocate` first, and when it does not, it gets a
dedicated exception it can catch (and then preempt someone) without catching real bugs.
Mistakes of the caller (unknown request, bad argument) are ``KeyError``/``ValueError``/
``TypeError``.
"""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """A KV cache group has fewer free blocks than an allocation needs; nothing was allocated."""


class OutOfRowsError(RuntimeError):
    """Every table row is held by a request; the request was not admitted."""


class IntegrityError(AssertionError):
    """``check_integrity()`` found an inconsistency (a bug in blocktable, never in the caller)."""
