"""How a message travels: one byte buffer holding its numpy arrays' memory, then a pickle.

A round's messages (an :class:`~blocktable.transfer.messages.OfferBatch` of 64 prompts, a
plan) are mostly a few flat numpy arrays. Pickling an array costs more than copying its bytes,
so a message that can split itself (``to_wire() -> (arrays, rest)`` and the class method
``from_wire(arrays, rest)``, see :class:`WireMessage`) travels as its arrays' bytes laid out
in one buffer, then a small pickle of the rest (request ids, flags, reasons) and of each
array's dtype and length. Any other object is pickled whole. The receiver views the arrays in
the landed buffer (no copy)::

    header (int64 [2]): the body's bytes, where its pickle starts
    body (uint8):       array 0 | pad | array 1 | pad | ... | pickle

Arrays start at multiples of :data:`ALIGN_BYTES`. A message is two sends, whatever it holds.
A sender keeps one :class:`MessageWriter`, whose body buffer every message reuses.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

HEADER_LEN = 2
"""int64 entries of a message header: the body's bytes, then where its pickle starts."""

ALIGN_BYTES = 16
"""Every array in a body starts at a multiple of this many bytes."""

class WireMessage(Protocol):
    """A message that travels as flat arrays plus a small picklable rest."""

    def to_wire(self) -> tuple[Sequence[np.ndarray], Any]:
        """Its 1-D numpy arrays (plain dtypes) and everything else."""

    @classmethod
    def from_wire(cls, arrays: list[np.ndarray], rest: Any) -> Any:
        """The message again, from what :meth:`to_wire` gave (the arrays as views)."""


class MessageWriter:
    """Encodes messages into one body buffer it keeps, grown when a larger message comes and
    never shrunk: a fresh buffer per message would fault in its pages every round (a round's
    offer carries every prompt's token ids), which costs more than copying them.

    :meth:`encode`'s arrays are valid until its next call: a sender encodes, sends, and waits
    for the send before it encodes again (as :class:`~blocktable.transfer.transport.
    TorchDistributedTransport` does)."""

    def __init__(self) -> None:
        self._body = np.empty(0, dtype=np.uint8)
        self._header = np.zeros(HEADER_LEN, dtype=np.int64)

    def encode(self, obj: Any) -> tuple[np.ndarray, np.ndarray]:
        """``obj`` as ``(header, body)``: int64 ``[HEADER_LEN]`` and uint8 ``[header[0]]`` on
        cpu, views of this writer's memory. A :class:`WireMessage`'s arrays are copied once,
        into ``body``."""
        to_wire = getattr(type(obj), "to_wire", None)
        if to_wire is None:
            arrays: Sequence[np.ndarray] = ()
            tail = pickle.dumps((None, obj, ()), protocol=5)
        else:
            arrays, rest = to_wire(obj)
        layout: list[tuple[str, int, int]] = []
        end = 0
        for a in arrays:
            if a.ndim != 1 or a.dtype.kind in "OV":  # objects, structured or void records
                raise ValueError(f"{type(obj).__name__}.to_wire must give 1-D arrays of "
                                 f"plain dtypes, got {a.dtype} of shape {a.shape}")
            end += -end % ALIGN_BYTES
            layout.append((a.dtype.str, a.size, end))
            end += a.nbytes
        if to_wire is not None:
            tail = pickle.dumps((type(obj), rest, layout), protocol=5)
        size = end + len(tail)
        if self._body.size < size:
            # zeros: the padding never carries stale heap bytes (only earlier messages')
            self._body = np.zeros(max(size, 2 * self._body.size), dtype=np.uint8)
        body = self._body[:size]
        for a, (dtype, count, offset) in zip(arrays, layout):
            # a typed view of the body (offsets are aligned): strided arrays copy in place
            np.copyto(body[offset:offset + a.nbytes].view(a.dtype), a)
        body[end:] = np.frombuffer(tail, dtype=np.uint8)
        header = self._header
        header[0], header[1] = size, end
        return header, body


def encode_message(obj: Any) -> tuple[np.ndarray, np.ndarray]:
    """``obj`` as ``(header, body)`` in new arrays (:meth:`MessageWriter.encode` of a new
    writer)."""
    return MessageWriter().encode(obj)


def decode_message(header: np.ndarray, body: np.ndarray) -> Any:
    """The object :func:`encode_message` made ``(header, body)`` of; its arrays view
    ``body``'s memory."""
    size, start = int(header[0]), int(header[1])
    if body.dtype != np.uint8 or body.ndim != 1 or body.size != size or not 0 <= start < size:
        raise ValueError(f"body must be uint8 [{size}] with its pickle at [{start}, {size}), "
                         f"got {body.dtype} {list(body.shape)}")
    cls, rest, layout = pickle.loads(body[start:].data)
    if cls is None:
        return rest
    arrays = [np.frombuffer(body, dtype=dtype, count=count, offset=offset)
              for dtype, count, offset in layout]
    return cls.from_wire(arrays, rest)


def check_header(header: np.ndarray) -> int:
    """The body's bytes a received ``header`` announces (raises on a malformed one)."""
    size, start = int(header[0]), int(header[1])
    if size < 1 or not 0 <= start < size:
        raise ValueError(f"a message header must give a body of >= 1 bytes and its pickle's "
                         f"start inside it, got {size} bytes, pickle at {start}")
    return size
