"""How a message travels: a fixed int64 header, one body of int64 words and text, and its large
arrays as they are; no pickle for a round.

A round's messages (an :class:`~blocktable.transfer.messages.OfferBatch` of 64 prompts, a
plan) are a few flat integer arrays, some strings (request ids) and one integer. A class that
says so (:class:`WireMessage`: a registered ``WIRE_KIND``, its number of arrays
``WIRE_NUM_ARRAYS``, ``to_wire`` and ``from_wire``) travels in a fixed binary form: the header
holds its kind, its integer and every array's length; the body, its small arrays as int64
words back to back, then its strings in UTF-8 joined by NUL. An array of :data:`BULK_ITEMS`
entries or more (a round's token ids) is not copied into the body: it travels as its own send,
from its own memory. The receiver views the small arrays in the landed body (one
``np.frombuffer`` and a slice each), takes the large ones as they landed, and splits the
strings once::

    header (int64 [HEADER_LEN]): body bytes | kind | value | number of strings | length of
                                 array 0 | ... | length of array MAX_ARRAYS - 1
    body (uint8):                int64 words: small array | small array | ... ; then strings
    then each large array (int64), in order

Both sides tell a large array from a small one by its length (:func:`bulk_arrays`). Any
other object (the handshake's layout, a context-parallel plan) is pickled whole (kind 0). A
sender keeps one :class:`MessageWriter`, whose buffer every message reuses.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

MAX_ARRAYS = 6
"""Arrays one message may carry."""

HEADER_LEN = 4 + MAX_ARRAYS
"""int64 entries of a message header."""

BULK_ITEMS = 1 << 13
"""An array of at least this many entries (64 KiB of int64) travels as its own send, not
copied into the body."""

PICKLED = 0
"""The kind of a message pickled whole."""

TEXT_SEPARATOR = "\0"
"""Between the strings of a message (a string holding it cannot travel)."""

_KINDS: dict[int, Any] = {}  # kind -> WireMessage class, filled by register_message
_NUM_ARRAYS: dict[int, int] = {}  # kind -> its arrays
_HEADER = struct.Struct(f"={HEADER_LEN}q")
_ZEROS = (0,) * MAX_ARRAYS
_INT64 = np.dtype(np.int64)


class WireMessage(Protocol):
    """A message that travels as flat integer arrays, strings and one integer."""

    WIRE_KIND: ClassVar[int]  # > 0, the same in every process (see register_message)
    WIRE_NUM_ARRAYS: ClassVar[int]  # its arrays, at most MAX_ARRAYS

    def to_wire(self) -> tuple[Sequence[np.ndarray], Sequence[str], int]:
        """Its 1-D integer arrays (any strides; values that fit int64), its strings and one
        integer."""

    @classmethod
    def from_wire(cls, arrays: list[np.ndarray], texts: list[str], value: int) -> Any:
        """The message again, from what :meth:`to_wire` gave (the arrays as int64 views of
        the landed body, or the large ones as they landed)."""


T = TypeVar("T", bound=type)


def register_message(kind: int) -> Callable[[T], T]:
    """Class decorator: messages of this class travel in the fixed form as ``kind`` (> 0,
    unique; sender and receiver must register the same classes under the same kinds)."""

    def register(cls: T) -> T:
        if kind <= PICKLED or kind in _KINDS:
            raise ValueError(f"message kind {kind} of {cls.__name__} must be > 0 and not "
                             f"taken (taken: {sorted(_KINDS)})")
        num_arrays = getattr(cls, "WIRE_NUM_ARRAYS", None)
        if (not isinstance(num_arrays, int) or isinstance(num_arrays, bool)
                or not 0 <= num_arrays <= MAX_ARRAYS):
            raise ValueError(f"{cls.__name__}.WIRE_NUM_ARRAYS must be an int in [0, "
                             f"{MAX_ARRAYS}], got {num_arrays!r}")
        message: Any = cls
        message.WIRE_KIND = kind
        _KINDS[kind] = cls
        _NUM_ARRAYS[kind] = num_arrays
        return cls

    return register


def bulk_arrays(header: np.ndarray) -> list[tuple[np.dtype, int]]:
    """``(dtype, length)`` of each large array that follows the body of the message whose
    ``header`` this is, in order (none for a pickled one or an unknown kind)."""
    num_arrays = _NUM_ARRAYS.get(int(header[1]))
    if num_arrays is None:
        return []
    lengths = header[4:4 + num_arrays].tolist()
    if lengths and min(lengths) < 0:
        raise ValueError(f"a {_KINDS[int(header[1])].__name__} header gives arrays of "
                         f"{lengths} entries")
    return [(_INT64, count) for count in lengths if count >= BULK_ITEMS]


class MessageWriter:
    """Encodes messages into one buffer it keeps (int64 words, grown when a larger message
    comes, never shrunk: a fresh buffer per message would fault in its pages every round).

    :meth:`encode`'s header and body are valid until its next call, and its large arrays are
    the message's own memory (when int64 and contiguous): a sender encodes, sends, and waits
    for the send before it encodes again or changes the message (as
    :class:`~blocktable.transfer.transport.TorchDistributedTransport` does)."""

    def __init__(self) -> None:
        self._words = np.zeros(0, dtype=np.int64)
        self._bytes = np.zeros(0, dtype=np.uint8)
        self._memory = memoryview(bytearray())
        # (packed into its bytearray, which struct writes without numpy's buffer export)
        self._header_bytes = bytearray(8 * HEADER_LEN)
        self._header = np.frombuffer(self._header_bytes, dtype=np.int64)

    def _room(self, num_bytes: int) -> np.ndarray:
        """The body buffer (uint8), holding at least ``num_bytes``: a bytearray (zeros) seen
        as int64 words, as bytes and as a memoryview (strings and pickles are copied in
        through it, with no buffer export of an array per message)."""
        if self._bytes.size < num_bytes:
            num_words = max(-(-num_bytes // 8), 2 * self._words.size)
            memory = bytearray(8 * num_words)
            self._memory = memoryview(memory)
            self._words = np.frombuffer(memory, dtype=np.int64)
            self._bytes = np.frombuffer(memory, dtype=np.uint8)
        return self._bytes

    def encode(self, obj: Any) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """``obj`` as ``(header, body)`` (int64 ``[HEADER_LEN]`` and uint8 ``[header[0]]`` on
        cpu, views of this writer's memory) and its large arrays (int64, contiguous: the
        message's own when they are). A :class:`WireMessage`'s small arrays are copied once,
        into ``body``.

        Raises
        ------
        ValueError
            A message whose ``to_wire`` gives another number of arrays than its
            ``WIRE_NUM_ARRAYS``, an array that is not 1-D or not of a signed integer dtype (or
            unsigned of at most 32 bits), or a string holding :data:`TEXT_SEPARATOR` (nothing
            is sent).
        """
        cls: Any = type(obj)
        kind = getattr(cls, "WIRE_KIND", PICKLED)
        if kind == PICKLED:
            data = pickle.dumps(obj, protocol=5)
            size = len(data)
            self._room(size)
            self._memory[:size] = data
            _HEADER.pack_into(self._header_bytes, 0, size, PICKLED, 0, 0, *_ZEROS)
            return self._header, self._bytes[:size], []
        arrays, texts, value = obj.to_wire()
        num_arrays = _NUM_ARRAYS[kind]
        if len(arrays) != num_arrays:
            raise ValueError(f"{cls.__name__}.to_wire gave {len(arrays)} arrays, "
                             f"{num_arrays} expected")
        small: list[np.ndarray] = []
        bulk: list[np.ndarray] = []
        lengths: list[int] = []
        num_words = 0
        for a in arrays:
            dtype = a.dtype
            if a.ndim != 1 or not (dtype.kind == "i" or dtype.kind == "u" and dtype.itemsize < 8):
                raise ValueError(f"{cls.__name__}.to_wire must give 1-D integer arrays (int64 "
                                 f"values), got {a.dtype} of shape {a.shape}")
            count = a.shape[0]
            lengths.append(count)
            if count >= BULK_ITEMS:
                bulk.append(np.ascontiguousarray(a, _INT64))
            elif count:
                small.append(a)
                num_words += count
        num_texts = len(texts)
        joined = TEXT_SEPARATOR.join(texts)
        if joined.count(TEXT_SEPARATOR) != num_texts - (num_texts > 0):
            bad = next(t for t in texts if TEXT_SEPARATOR in t)
            raise ValueError(f"{cls.__name__}: the string {bad!r} holds a NUL character, "
                             "which cannot travel")
        text = joined.encode()
        start = 8 * num_words
        size = start + len(text)
        body = self._room(size)
        words, end = self._words, 0
        for a in small:  # int64 words back to back (a slice assignment each: cheaper, with a
            # round's caches cold, than one np.concatenate of two or three)
            words[end:end + a.shape[0]] = a
            end += a.shape[0]
        if text:
            self._memory[start:size] = text
        _HEADER.pack_into(self._header_bytes, 0, size, kind, value, num_texts, *lengths,
                          *_ZEROS[num_arrays:])
        return self._header, body[:size], bulk


def encode_message(obj: Any) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """``obj`` as ``(header, body, bulk)`` (:meth:`MessageWriter.encode` of a new writer)."""
    return MessageWriter().encode(obj)


def decode_message(header: np.ndarray, body: np.ndarray, bulk: Sequence[np.ndarray] = ()
                   ) -> Any:
    """The object :func:`encode_message` made ``(header, body, bulk)`` of; its small arrays
    are int64 views of ``body``'s memory, its large ones are ``bulk``'s arrays.

    Raises
    ------
    ValueError
        A header that does not fit the body or the large arrays, or an unknown kind (nothing
        is kept).
    """
    size, kind, value, num_texts, *lengths = header.tolist()
    if body.dtype != np.uint8 or body.ndim != 1 or body.size != size:
        raise ValueError(f"body must be uint8 [{size}], got {body.dtype} {list(body.shape)}")
    if kind == PICKLED:
        return pickle.loads(body.data)
    num_arrays = _NUM_ARRAYS.get(kind)
    if num_arrays is None:
        raise ValueError(f"unknown message kind {kind} (known: {sorted(_KINDS)})")
    cls = _KINDS[kind]
    unused, lengths = lengths[num_arrays:], lengths[:num_arrays]
    if any(unused) or num_texts < 0 or (lengths and min(lengths) < 0):
        _no_fit(cls, header, size)
    words = np.frombuffer(body, _INT64, size >> 3)  # (the text's whole words too)
    arrays: list[np.ndarray] = []
    end = num_bulk = 0
    for count in lengths:  # one walk of the layout, as encode made it
        if count < BULK_ITEMS:
            arrays.append(words[end:end + count])
            end += count
            continue
        a = bulk[num_bulk] if num_bulk < len(bulk) else None  # landed on its own
        if a is None or a.dtype != _INT64 or a.shape != (count,):
            num_bulk = -1
            break
        arrays.append(a)
        num_bulk += 1
    if end > words.size:
        _no_fit(cls, header, size)
    if num_bulk != len(bulk):
        raise ValueError(
            f"a {cls.__name__} header gives large arrays of "
            f"{[(str(d), n) for d, n in bulk_arrays(header)]}, got "
            f"{[(str(a.dtype), a.size) for a in bulk]}")
    texts = str(memoryview(body)[8 * end:], "utf-8").split(TEXT_SEPARATOR) if (
        num_texts) else []
    if len(texts) != num_texts:
        raise ValueError(f"a {cls.__name__} header gives {num_texts} strings, its body holds "
                         f"{len(texts)}")
    return cls.from_wire(arrays, texts, value)


def _no_fit(cls: Any, header: np.ndarray, size: int) -> None:
    raise ValueError(f"a {cls.__name__} header gives arrays of {header[4:].tolist()} entries, "
                     f"{int(header[3])} strings and a body of {size} bytes, which do not fit")


def check_header(header: np.ndarray) -> int:
    """The body's bytes a received ``header`` announces (raises on a malformed one)."""
    size = int(header[0])
    if size < 0:
        raise ValueError(f"a message header must give a body of >= 0 bytes, got {size}")
    return size
