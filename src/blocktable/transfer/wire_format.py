"""How a message travels: a fixed int64 header, one byte buffer, and its large arrays as they
are; no pickle for a round.

A round's messages (an :class:`~blocktable.transfer.messages.OfferBatch` of 64 prompts, a
plan) are a few flat numpy arrays, some strings (request ids) and one integer. A class that
says so (:class:`WireMessage`: a registered ``WIRE_KIND``, its arrays' ``WIRE_DTYPES``,
``to_wire`` and ``from_wire``) travels in a fixed binary form: the header holds its kind, its
integer and every array's length, the body its small arrays' bytes, then its strings in UTF-8
joined by NUL. An array of :data:`BULK_BYTES` or more (a round's token ids) is not copied
into the body: it travels as its own send, from its own memory. The receiver views the small
arrays in the landed body, takes the large ones as they landed, and splits the strings once::

    header (int64 [HEADER_LEN]): body bytes | kind | value | number of strings | length of
                                 array 0 | ... | length of array MAX_ARRAYS - 1
    body (uint8):                small array | pad | small array | pad | ... | strings
    then each large array, in order

Both sides tell a large array from a small one by its length and dtype (:func:`bulk_arrays`).
Arrays start at multiples of :data:`ALIGN_BYTES`. Any other object (the handshake's layout, a
context-parallel plan) is pickled whole (kind 0). A sender keeps one :class:`MessageWriter`,
whose body buffer every message reuses.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

MAX_ARRAYS = 6
"""Arrays one message may carry."""

HEADER_LEN = 4 + MAX_ARRAYS
"""int64 entries of a message header."""

ALIGN_BYTES = 16
"""Every array in a body starts at a multiple of this many bytes."""

BULK_BYTES = 1 << 16
"""An array of at least this many bytes travels as its own send, not copied into the body."""

PICKLED = 0
"""The kind of a message pickled whole."""

TEXT_SEPARATOR = "\0"
"""Between the strings of a message (a string holding it cannot travel)."""

_KINDS: dict[int, Any] = {}  # kind -> WireMessage class, filled by register_message
# kind -> per array: its dtype, item size and the length from which it travels on its own
_SPECS: dict[int, tuple[tuple[np.dtype, int, int], ...]] = {}
_NEVER = 1 << 62  # a length no array reaches: a non-native dtype always travels in the body
_PADS = [bytes(n) for n in range(ALIGN_BYTES)]  # zero bytes up to the next array's alignment
_ZEROS = [0] * MAX_ARRAYS
_EMPTIES: dict[np.dtype, np.ndarray] = {}  # dtype -> its read-only empty array


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
        message: Any = cls
        dtypes = tuple(np.dtype(d) for d in message.WIRE_DTYPES)
        if len(dtypes) > MAX_ARRAYS or any(d.kind in "OV" for d in dtypes):
            raise ValueError(f"{cls.__name__}.WIRE_DTYPES must be at most {MAX_ARRAYS} plain "
                             f"dtypes, got {dtypes}")
        message.WIRE_KIND, message.WIRE_DTYPES = kind, dtypes
        _KINDS[kind] = cls
        # (a tensor holds native bytes only: a non-native array is always copied in)
        _SPECS[kind] = tuple((d, d.itemsize, -(-BULK_BYTES // d.itemsize)
                              if d.isnative and d.itemsize else _NEVER) for d in dtypes)
        return cls

    return register


def bulk_arrays(header: np.ndarray) -> list[tuple[np.dtype, int]]:
    """``(dtype, length)`` of each large array that follows the body of the message whose
    ``header`` this is, in order (none for a pickled one or an unknown kind)."""
    kind = int(header[1])
    cls = _KINDS.get(kind)
    if cls is None:
        return []
    lengths = header[4:].tolist()
    if min(lengths) < 0:
        raise ValueError(f"a {cls.__name__} header gives arrays of {lengths} entries")
    return [(dtype, count) for (dtype, _, bulk_from), count in zip(_SPECS[kind], lengths)
            if count >= bulk_from]


class MessageWriter:
    """Encodes messages into one body buffer it keeps, grown when a larger message comes and
    never shrunk: a fresh buffer per message would fault in its pages every round.

    :meth:`encode`'s header and body are valid until its next call, and its large arrays are
    the message's own memory: a sender encodes, sends, and waits for the send before it
    encodes again or changes the message (as :class:`~blocktable.transfer.transport.
    TorchDistributedTransport` does)."""

    def __init__(self) -> None:
        self._body = np.empty(0, dtype=np.uint8)
        self._header = np.zeros(HEADER_LEN, dtype=np.int64)

    def encode(self, obj: Any) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """``obj`` as ``(header, body, bulk)``: int64 ``[HEADER_LEN]`` and uint8
        ``[header[0]]`` on cpu, views of this writer's memory, and the large arrays
        (contiguous: the message's own when they are). A :class:`WireMessage`'s small arrays
        are copied once, into ``body``.

        Raises
        ------
        ValueError
            An array that is not 1-D or not of its ``WIRE_DTYPES`` entry's kind, or a string
            holding :data:`TEXT_SEPARATOR` (nothing is sent).
        """
        cls: Any = type(obj)
        kind = getattr(cls, "WIRE_KIND", PICKLED)
        bulk: list[np.ndarray] = []
        lengths: list[int] = []
        if kind == PICKLED:
            parts: list[bytes] = [pickle.dumps(obj, protocol=5)]
            value = num_texts = 0
        else:
            arrays, texts, value = obj.to_wire()
            spec = _SPECS[kind]
            if len(arrays) != len(spec):
                raise ValueError(f"{cls.__name__}.to_wire gave {len(arrays)} arrays, "
                                 f"{len(spec)} expected")
            num_texts = len(texts)
            joined = TEXT_SEPARATOR.join(texts)
            if joined.count(TEXT_SEPARATOR) != num_texts - (num_texts > 0):
                bad = next(t for t in texts if TEXT_SEPARATOR in t)
                raise ValueError(f"{cls.__name__}: the string {bad!r} holds a NUL character, "
                                 "which cannot travel")
            # one walk of the layout: the small arrays' bytes at their aligned offsets (each
            # padded with zeros, an empty one too), the large ones sent from where they are,
            # then the strings; joined once and copied once into the body
            parts, end = [], 0
            for a, (dtype, itemsize, bulk_from) in zip(arrays, spec):
                if a.ndim != 1 or a.dtype.kind != dtype.kind:
                    raise ValueError(f"{cls.__name__}.to_wire must give 1-D {dtype} arrays, "
                                     f"got {a.dtype} of shape {a.shape}")
                count = a.shape[0]
                lengths.append(count)
                if count >= bulk_from:
                    bulk.append(np.ascontiguousarray(a, dtype))
                    continue
                pad = -end % ALIGN_BYTES
                if pad:
                    parts.append(_PADS[pad])
                if count:
                    parts.append((a if a.dtype == dtype else a.astype(dtype)).tobytes())
                end += pad + count * itemsize
            parts.append(joined.encode())
        tail = b"".join(parts)
        size = len(tail)
        if self._body.size < size:
            # zeros: the padding never carries stale heap bytes (only earlier messages')
            self._body = np.zeros(max(size, 2 * self._body.size), dtype=np.uint8)
        body = self._body[:size]
        memoryview(body)[:] = tail
        header = self._header
        header[:] = [size, kind, value, num_texts, *lengths, *_ZEROS[len(lengths):]]
        return header, body, bulk


def encode_message(obj: Any) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``obj`` as ``(header, body, bulk)`` (:meth:`MessageWriter.encode` of a new writer)."""
    return MessageWriter().encode(obj)


def decode_message(header: np.ndarray, body: np.ndarray, bulk: Sequence[np.ndarray] = ()
                   ) -> Any:
    """The object :func:`encode_message` made ``(header, body, bulk)`` of; its small arrays
    view ``body``'s memory (read-only), its large ones are ``bulk``'s arrays.

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
    spec = _SPECS[kind]
    arrays: list[np.ndarray] = []
    end = num_bulk = 0
    fits = min(lengths) >= 0 and not any(lengths[len(spec):]) and num_texts >= 0
    bulk_fits = True
    if fits:  # one walk of the layout, as encode made it
        for (dtype, itemsize, bulk_from), count in zip(spec, lengths):
            if count >= bulk_from:  # landed on its own
                a = bulk[num_bulk] if num_bulk < len(bulk) else None
                bulk_fits = bulk_fits and a is not None and a.dtype == dtype and (
                    a.shape == (count,))
                arrays.append(a)  # type: ignore[arg-type]  # (refused below when None)
                num_bulk += 1
                continue
            end += -end % ALIGN_BYTES
            start, end = end, end + count * itemsize
            if end > size:
                fits = False
                break
            arrays.append(np.frombuffer(body, dtype, count, start) if count else _empty(dtype))
    if not fits:
        raise ValueError(f"a {cls.__name__} header gives arrays of {lengths} entries, "
                         f"{num_texts} strings and a body of {size} bytes, which do not fit")
    if not bulk_fits or num_bulk != len(bulk):
        raise ValueError(
            f"a {cls.__name__} header gives {num_bulk} large arrays of "
            f"{[(str(d), n) for d, n in bulk_arrays(header)]}, got "
            f"{[(str(a.dtype), a.size) for a in bulk]}")
    texts = str(memoryview(body)[end:], "utf-8").split(TEXT_SEPARATOR) if num_texts else []
    if len(texts) != num_texts:
        raise ValueError(f"a {cls.__name__} header gives {num_texts} strings, its body holds "
                         f"{len(texts)}")
    return cls.from_wire(arrays, texts, value)


def _empty(dtype: np.dtype) -> np.ndarray:
    """A read-only empty array of ``dtype``, one per dtype (what an empty array decodes to)."""
    empty = _EMPTIES.get(dtype)
    if empty is None:
        empty = _EMPTIES[dtype] = np.zeros(0, dtype)
        empty.flags.writeable = False
    return empty


def check_header(header: np.ndarray) -> int:
    """The body's bytes a received ``header`` announces (raises on a malformed one)."""
    size = int(header[0])
    if size < 0:
        raise ValueError(f"a message header must give a body of >= 0 bytes, got {size}")
    return size
