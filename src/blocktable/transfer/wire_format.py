"""How a message travels: a fixed int64 header, then one byte buffer; no pickle for a round.

A round's messages (an :class:`~blocktable.transfer.messages.OfferBatch` of 64 prompts, a
plan) are a few flat numpy arrays, some strings (request ids) and one integer. A class that
says so (:class:`WireMessage`: a registered ``WIRE_KIND``, its arrays' ``WIRE_DTYPES``,
``to_wire`` and ``from_wire``) travels in a fixed binary form: the header holds its kind, its
integer and every array's length, the body its arrays' bytes, then its strings in UTF-8
joined by NUL. The receiver views the arrays in the landed body (no copy) and splits the
strings once::

    header (int64 [HEADER_LEN]): body bytes | kind | value | number of strings | length of
                                 array 0 | ... | length of array MAX_ARRAYS - 1
    body (uint8):                array 0 | pad | array 1 | pad | ... | strings

Arrays start at multiples of :data:`ALIGN_BYTES`. Any other object (the handshake's layout,
a context-parallel plan) is pickled whole (kind 0). A message is two sends, whatever it holds.
A sender keeps one :class:`MessageWriter`, whose body buffer every message reuses.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

MAX_ARRAYS = 4
"""Arrays one message may carry."""

HEADER_LEN = 4 + MAX_ARRAYS
"""int64 entries of a message header."""

ALIGN_BYTES = 16
"""Every array in a body starts at a multiple of this many bytes."""

PICKLED = 0
"""The kind of a message pickled whole."""

TEXT_SEPARATOR = "\0"
"""Between the strings of a message (a string holding it cannot travel)."""

_KINDS: dict[int, type] = {}  # kind -> WireMessage class, filled by register_message


class WireMessage(Protocol):
    """A message that travels as flat arrays, strings and one integer."""

    WIRE_KIND: ClassVar[int]  # > 0, the same in every process (see register_message)
    WIRE_DTYPES: ClassVar[tuple[np.dtype, ...]]  # its arrays' dtypes, in order

    def to_wire(self) -> tuple[Sequence[np.ndarray], Sequence[str], int]:
        """Its 1-D arrays (of ``WIRE_DTYPES``, any strides), its strings and one integer."""

    @classmethod
    def from_wire(cls, arrays: list[np.ndarray], texts: list[str], value: int) -> Any:
        """The message again, from what :meth:`to_wire` gave (the arrays as read-only
        views of the landed body)."""


T = TypeVar("T", bound=type)


def register_message(kind: int) -> Callable[[T], T]:
    """Class decorator: messages of this class travel in the fixed form as ``kind`` (> 0,
    unique; sender and receiver must register the same classes under the same kinds)."""

    def register(cls: T) -> T:
        if kind <= PICKLED or kind in _KINDS:
            raise ValueError(f"message kind {kind} of {cls.__name__} must be > 0 and not "
                             f"taken (taken: {sorted(_KINDS)})")
        dtypes = tuple(np.dtype(d) for d in cls.WIRE_DTYPES)
        if len(dtypes) > MAX_ARRAYS or any(d.kind in "OV" for d in dtypes):
            raise ValueError(f"{cls.__name__}.WIRE_DTYPES must be at most {MAX_ARRAYS} plain "
                             f"dtypes, got {dtypes}")
        cls.WIRE_KIND, cls.WIRE_DTYPES = kind, dtypes  # type: ignore[attr-defined]
        _KINDS[kind] = cls
        return cls

    return register


def _layout(lengths: Sequence[int], dtypes: Sequence[np.dtype]) -> tuple[list[int], int]:
    """Each array's byte offset in the body, and where the strings start."""
    offsets, end = [], 0
    for count, dtype in zip(lengths, dtypes):
        end += -end % ALIGN_BYTES
        offsets.append(end)
        end += count * dtype.itemsize
    return offsets, end


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
        into ``body``.

        Raises
        ------
        ValueError
            An array that is not 1-D or not of its ``WIRE_DTYPES`` entry's kind, or a string
            holding :data:`TEXT_SEPARATOR` (nothing is sent).
        """
        cls = type(obj)
        kind = getattr(cls, "WIRE_KIND", PICKLED)
        if kind == PICKLED:
            arrays: Sequence[np.ndarray] = ()
            lengths: list[int] = []
            value, num_texts = 0, 0
            tail = pickle.dumps(obj, protocol=5)
        else:
            arrays, texts, value = obj.to_wire()
            dtypes = cls.WIRE_DTYPES
            if len(arrays) != len(dtypes):
                raise ValueError(f"{cls.__name__}.to_wire gave {len(arrays)} arrays, "
                                 f"{len(dtypes)} expected")
            lengths = [a.shape[0] for a in arrays]
            num_texts = len(texts)
            joined = TEXT_SEPARATOR.join(texts)
            if joined.count(TEXT_SEPARATOR) != num_texts - (num_texts > 0):
                bad = next(t for t in texts if TEXT_SEPARATOR in t)
                raise ValueError(f"{cls.__name__}: the string {bad!r} holds a NUL character, "
                                 "which cannot travel")
            tail = joined.encode()
        offsets, end = _layout(lengths, cls.WIRE_DTYPES if kind else ())
        size = end + len(tail)
        if self._body.size < size:
            # zeros: the padding never carries stale heap bytes (only earlier messages')
            self._body = np.zeros(max(size, 2 * self._body.size), dtype=np.uint8)
        body = self._body[:size]
        for a, dtype, offset in zip(arrays, cls.WIRE_DTYPES if kind else (), offsets):
            if a.ndim != 1 or a.dtype.kind != dtype.kind:
                raise ValueError(f"{cls.__name__}.to_wire must give 1-D {dtype} arrays, got "
                                 f"{a.dtype} of shape {a.shape}")
            # a typed view of the body (offsets are aligned): strided arrays copy in place
            np.copyto(np.frombuffer(body, dtype, a.shape[0], offset), a)
        body[end:] = np.frombuffer(tail, dtype=np.uint8)
        header = self._header
        header[:] = (size, kind, value, num_texts, *lengths, *[0] * (MAX_ARRAYS - len(lengths)))
        return header, body


def encode_message(obj: Any) -> tuple[np.ndarray, np.ndarray]:
    """``obj`` as ``(header, body)`` in new arrays (:meth:`MessageWriter.encode` of a new
    writer)."""
    return MessageWriter().encode(obj)


def decode_message(header: np.ndarray, body: np.ndarray) -> Any:
    """The object :func:`encode_message` made ``(header, body)`` of; its arrays view
    ``body``'s memory (read-only).

    Raises
    ------
    ValueError
        A header that does not fit the body, or an unknown kind (nothing is kept).
    """
    size, kind, value, num_texts, *lengths = header.tolist()
    if body.dtype != np.uint8 or body.ndim != 1 or body.size != size:
        raise ValueError(f"body must be uint8 [{size}], got {body.dtype} {list(body.shape)}")
    if kind == PICKLED:
        return pickle.loads(body.data)
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown message kind {kind} (known: {sorted(_KINDS)})")
    dtypes = cls.WIRE_DTYPES
    offsets, end = _layout(lengths, dtypes)
    if min(lengths) < 0 or any(lengths[len(dtypes):]) or end > size or num_texts < 0:
        raise ValueError(f"a {cls.__name__} header gives arrays of {lengths} entries, "
                         f"{num_texts} strings and a body of {size} bytes, which do not fit")
    arrays = [np.frombuffer(body, dtype, count, offset)
              for dtype, count, offset in zip(dtypes, lengths, offsets)]
    texts = bytes(body[end:]).decode().split(TEXT_SEPARATOR) if num_texts else []
    if len(texts) != num_texts:
        raise ValueError(f"a {cls.__name__} header gives {num_texts} strings, its body holds "
                         f"{len(texts)}")
    return cls.from_wire(arrays, texts, value)


def check_header(header: np.ndarray) -> int:
    """The body's bytes a received ``header`` announces (raises on a malformed one)."""
    size = int(header[0])
    if size < 0:
        raise ValueError(f"a message header must give a body of >= 0 bytes, got {size}")
    return size
