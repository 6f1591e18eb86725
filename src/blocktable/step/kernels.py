"""Device side of a captured step: the commit scatter that reads its size from the staged header.

The pair count is loaded from device memory (the staging buffer's header), not passed as a
launch argument, so one launch with a grid sized by the capacity serves every step and can be
captured in a CUDA graph. Program 0 also writes the step's sequence number into a *mailbox*
(pinned host memory mapped into the device's address space): the host reads it with numpy to
learn that the copy of that staging buffer has finished, without a CUDA call.
"""

from __future__ import annotations

import torch

from blocktable._triton import HAS_TRITON, Launcher, cdiv, tl, triton
from blocktable.step.layout import HEADER_WORDS, NUM_PAIRS, SEQ, SLOT

if HAS_TRITON:

    @triton.jit
    def _staged_scatter_kernel(
        table_ptr,  # int32 [num_entries]: the flat device table
        staging_ptr,  # int32 [num_words]: the device copy of a staging buffer
        mailbox_ptr,  # int32 [2]: pinned host memory (or a device stand-in)
        PAIRS: tl.constexpr,  # word offset of the pairs
        BLOCK: tl.constexpr,
    ):
        n = tl.load(staging_ptr + 0)  # header[NUM_PAIRS]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        index = tl.load(staging_ptr + PAIRS + offs, mask=mask, other=0)
        value = tl.load(staging_ptr + PAIRS + n + offs, mask=mask, other=0)
        tl.store(table_ptr + index, value, mask=mask)
        if tl.program_id(0) == 0:
            seq = tl.load(staging_ptr + 1)  # header[SEQ]
            slot = tl.load(staging_ptr + 2)  # header[SLOT]
            tl.store(mailbox_ptr + slot, seq)

    _launch = Launcher(_staged_scatter_kernel)

assert (NUM_PAIRS, SEQ, SLOT) == (0, 1, 2) and HEADER_WORDS == 4  # the kernel's header offsets

SCATTER_BLOCK = 1024


def launch_staged_scatter(
    flat_table: torch.Tensor, staging: torch.Tensor, mailbox: torch.Tensor, max_pairs: int
) -> None:
    """Scatter the staged pairs of ``staging`` (int32, a staging buffer's device copy) into
    ``flat_table`` and post the step's sequence number to ``mailbox``; grid from ``max_pairs``."""
    if not HAS_TRITON:
        raise RuntimeError("a captured step on CUDA needs the triton package")
    _launch((max(1, cdiv(max_pairs, SCATTER_BLOCK)),), flat_table, staging, mailbox,
            HEADER_WORDS, SCATTER_BLOCK)
