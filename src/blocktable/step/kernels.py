"""Device side of a captured step: the commit scatter that reads its size from the staged header.

The pair count is loaded from memory (the staging buffer's header), not passed as a launch
argument, so one launch with a grid sized by the capacity serves every step and can be captured
in a CUDA graph. The step's sequence number goes into a *mailbox* (pinned host memory mapped
into the device's address space): the host reads it with numpy to learn that the device has
read that staging buffer, without a CUDA call.

Two ways to reach the staging buffer:

- **Read in place** (where the device can read pinned host memory, as it must to post to the
  mailbox): :func:`launch_direct_scatter` reads the header and the pairs straight from the
  pinned buffer, scatters them, and copies the batch's words to the device buffer that the
  slot mapping and attention read. :func:`launch_post` then posts the sequence number, after
  every read of the buffer. A graph of kernels only costs the host less to replay than one
  with a copy node.
- **Copied first**: a copy of the whole buffer to the device, then :func:`launch_staged_scatter`,
  whose program 0 posts the sequence number (everything it reads is on the device by then).
"""

from __future__ import annotations

import torch

from blocktable._triton import HAS_TRITON, Launcher, cdiv, tl, triton
from blocktable.step.layout import BATCH_WORDS, HEADER_WORDS, NUM_PAIRS, SEQ, SLOT, StepLayout

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

    @triton.jit(do_not_specialize_on_alignment=["staging_ptr"])
    def _direct_scatter_kernel(
        table_ptr,  # int32 [num_entries]: the flat device table
        staging_ptr,  # int32 [num_words]: a pinned staging buffer, read in place
        dev_ptr,  # int32 [num_words]: its device copy (header and batch words written)
        PAIRS: tl.constexpr,  # word offset of the pairs
        BATCH: tl.constexpr,  # word offset of the batch (qsl)
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        n = tl.load(staging_ptr + 0)  # header[NUM_PAIRS]
        words = tl.load(staging_ptr + 3)  # header[BATCH_WORDS]
        mask = offs < n
        index = tl.load(staging_ptr + PAIRS + offs, mask=mask, other=0)
        value = tl.load(staging_ptr + PAIRS + n + offs, mask=mask, other=0)
        in_batch = offs < words
        word = tl.load(staging_ptr + BATCH + offs, mask=in_batch, other=0)
        tl.store(table_ptr + index, value, mask=mask)
        tl.store(dev_ptr + BATCH + offs, word, mask=in_batch)
        if tl.program_id(0) == 0:  # the header, for the post that follows
            head = tl.arange(0, 4)
            tl.store(dev_ptr + head, tl.load(staging_ptr + head))

    _launch_direct = Launcher(_direct_scatter_kernel)

    @triton.jit
    def _post_kernel(
        dev_ptr,  # int32 [num_words]: the device copy of a staging buffer (its header)
        mailbox_ptr,  # int32 [2]: pinned host memory
    ):
        seq = tl.load(dev_ptr + 1)  # header[SEQ]
        slot = tl.load(dev_ptr + 2)  # header[SLOT]
        tl.store(mailbox_ptr + slot, seq)

    _launch_post = Launcher(_post_kernel)

# the kernels' header offsets
assert (NUM_PAIRS, SEQ, SLOT, BATCH_WORDS) == (0, 1, 2, 3) and HEADER_WORDS == 4

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


def launch_direct_scatter(flat_table: torch.Tensor, staging: torch.Tensor, dev: torch.Tensor,
                          layout: StepLayout) -> None:
    """Scatter the staged pairs of ``staging`` (int32 ``[num_words]``, a pinned staging
    buffer read in place) into ``flat_table`` (on the device), and copy its header and its
    batch words (``header[BATCH_WORDS]`` of them, from ``qsl`` on) into ``dev`` (int32
    ``[num_words]`` on the device); grid from the capacities."""
    if not HAS_TRITON:
        raise RuntimeError("a captured step on CUDA needs the triton package")
    most = max(layout.max_pairs, layout.batch_words(layout.max_num_tokens))
    _launch_direct((max(1, cdiv(most, SCATTER_BLOCK)),), flat_table, staging, dev,
                   HEADER_WORDS, layout.qsl, SCATTER_BLOCK)


def launch_post(dev: torch.Tensor, mailbox: torch.Tensor) -> None:
    """Post the sequence number in ``dev``'s header (int32 on the device, written by
    :func:`launch_direct_scatter`) to ``mailbox[slot]`` (pinned host memory): launched after
    every read of the staging buffer, in stream order."""
    if not HAS_TRITON:
        raise RuntimeError("a captured step on CUDA needs the triton package")
    _launch_post((1,), dev, mailbox, num_warps=1)
