"""The layout of a captured step's staging buffer: one int32 buffer, copied whole to the device.

::

    [ num_pairs : 1 | pairs : 2P | qsl : R+1 | rows : R | seq_lens : R | (pad) | positions : 2T
      | payload : W ]

``pairs`` holds the step's ``num_pairs`` changed flat table indices, then their values (packed:
the values start at ``pairs + num_pairs``): the same pairs :meth:`MultiGroupBlockTable.commit`
moves. ``qsl`` is padded past the batch with ``num_tokens``, so the padding requests own no
token. ``positions`` is int64 (int32 pairs), at an even word offset. ``payload`` is the caller's
own per-step inputs (an engine's token ids), carried to the device with the batch; it starts at
an even word offset too. ``P`` = most staged pairs, ``R`` = most requests, ``T`` = most tokens per
step, ``W`` = payload words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_PAIRS = 0  # the header's one word
HEADER_WORDS = 1


@dataclass(frozen=True)
class StepLayout:
    """Word offsets of the staging buffer for ``max_pairs``, ``max_num_reqs``,
    ``max_num_tokens`` and ``payload_words``."""

    max_pairs: int
    max_num_reqs: int
    max_num_tokens: int
    payload_words: int = 0

    @property
    def pairs(self) -> int:
        return HEADER_WORDS

    @property
    def qsl(self) -> int:
        return self.pairs + 2 * self.max_pairs

    @property
    def rows(self) -> int:
        return self.qsl + self.max_num_reqs + 1

    @property
    def seq_lens(self) -> int:
        return self.rows + self.max_num_reqs

    @property
    def positions(self) -> int:
        end = self.seq_lens + self.max_num_reqs
        return end + end % 2  # int64 values need an even int32 offset

    @property
    def payload(self) -> int:
        return self.positions + 2 * self.max_num_tokens

    @property
    def num_words(self) -> int:
        return self.payload + self.payload_words


class StagingViews:
    """numpy views of one staging buffer (int32 ``[num_words]``, on cpu) by field."""

    def __init__(self, buffer: np.ndarray, layout: StepLayout) -> None:
        L = layout
        self.buffer = buffer
        self.header = buffer[:HEADER_WORDS]
        self.header_pairs = buffer[: L.qsl]  # int32 [1 + 2P]: num_pairs, then the pairs
        self.pairs = buffer[L.pairs : L.qsl]  # int32 [2P]: indices, then values (packed)
        self.qsl = buffer[L.qsl : L.rows]  # int32 [R+1]
        self.rows = buffer[L.rows : L.seq_lens]  # int32 [R]
        self.seq_lens = buffer[L.seq_lens : L.seq_lens + L.max_num_reqs]  # int32 [R]
        self.positions = buffer[L.positions : L.payload].view(np.int64)  # int64 [T]
        self.payload = buffer[L.payload : L.num_words]  # int32 [W]
