# ruff: noqa: B023  (each lambda is called at once, inside its loop iteration)
"""The compiled token-id conversion and byte-chained hashes (``blocktable._compiled``): equal
to their Python twins (``struct.pack``, :func:`byte_chain_python`) on fresh random inputs, and
memory-safe on hostile ones: wrong containers and item types, huge and negative ints, lists
that an item's ``__index__`` changes mid-conversion, arrays of the wrong kind, ranges outside
the tokens, digests that are not bytes. Each must raise (``TypeError``, ``ValueError``,
``OverflowError``, or ``RuntimeError`` for a list changed under the conversion) and leave its
inputs as they were.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from blocktable import _compiled_loader
from blocktable.block_hashing import (
    ROOT_BLOCK_HASH,
    byte_chain,
    byte_chain_python,
    hash_block_tokens,
    sha256_block_hash,
)
from blocktable.token_ids import int64_from_ints_python, token_array, token_rows

compiled = pytest.importorskip("blocktable._compiled", reason="the compiled part is not built")

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
REFUSALS = (TypeError, ValueError, OverflowError, RuntimeError)


class Index:
    """An integer-like object with ``__index__`` (struct and the compiled loop accept it)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def random_ids(rng: np.random.Generator, n: int) -> list[object]:
    """Token ids of every accepted kind: ints across the whole int64 range and at its ends,
    bools, numpy integers of several widths, objects with ``__index__``."""
    out: list[object] = []
    for value in rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64, endpoint=True).tolist():
        kind = int(rng.integers(0, 12))
        if kind == 0:
            value = [I64_MIN, I64_MAX, 0, -1, 2**30, -(2**30), 2**31, 2**62][value % 8]
        elif kind == 1:
            value = bool(value & 1)
        elif kind == 2:
            value = np.int32(value % 2**31)
        elif kind == 3:
            value = np.int64(value)
        elif kind == 4:
            value = Index(value)
        elif kind < 8:
            value = value % 32000  # the usual token id: one digit
        out.append(value)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_int64_from_ints_equals_struct(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        ids = random_ids(rng, int(rng.integers(0, 300)))
        for values in (ids, tuple(ids)):
            got = compiled.int64_from_ints(values, "ids")
            want = int64_from_ints_python(values, "ids")
            assert got.dtype == np.int64 and got.flags.c_contiguous and got.flags.writeable
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(3))
def test_int64_from_int_lists_equals_each_list_converted(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        lists: list[object] = []
        for _ in range(int(rng.integers(0, 20))):
            if rng.random() < 0.2:
                lists.append(int(rng.integers(I64_MIN, I64_MAX, dtype=np.int64)))
            else:
                ids = random_ids(rng, int(rng.integers(0, 40)))
                lists.append(ids if rng.random() < 0.7 else tuple(ids))
        flat, offsets = compiled.int64_from_int_lists(lists, "token_ids")
        parts = [int64_from_ints_python([x] if type(x) is int else x, "t") for x in lists]
        assert offsets.dtype == np.int64 and flat.dtype == np.int64
        np.testing.assert_array_equal(offsets, np.cumsum([0] + [len(p) for p in parts]))
        np.testing.assert_array_equal(flat, np.concatenate([np.zeros(0, np.int64), *parts]))


def test_token_array_takes_either_path_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(7)
    ids = random_ids(rng, 500)
    for use in (compiled, None):
        monkeypatch.setattr(_compiled_loader, "COMPILED", use)
        np.testing.assert_array_equal(token_array("t", ids), int64_from_ints_python(ids, "t"))
        np.testing.assert_array_equal(token_array("t", tuple(ids)), token_array("t", ids))
        assert token_array("t", []).tolist() == []
        for bad in ([1, 2.5], [1, None], [2**63], [I64_MIN - 1], [1, "2"], [np.float32(1)]):
            with pytest.raises(TypeError, match="request 'x' must hold int64 token ids"):
                token_array("tokens of request 'x'", bad)


@pytest.mark.parametrize("seed", range(4))
def test_byte_chain_equals_python(seed: int) -> None:
    """Random tokens (any int64), segments (some empty), parents and namespaces; SHA-256
    (done without its Python function) and other callables, including digests of other
    lengths."""
    rng = np.random.default_rng(seed)
    fns = [
        sha256_block_hash,
        lambda d: hashlib.blake2b(d, digest_size=int(d[0]) % 40 + 1).digest(),
        lambda d: hashlib.md5(d).digest(),
    ]
    for _ in range(40):
        bs = int(rng.integers(1, 20))
        lengths = rng.integers(0, 5, int(rng.integers(0, 5))).astype(np.int64)
        tokens = rng.integers(
            I64_MIN, I64_MAX, int(lengths.sum()) * bs, dtype=np.int64, endpoint=True
        )
        parents = [rng.bytes(int(rng.choice([0, 1, 32, 77]))) for _ in lengths]
        namespaces = [rng.bytes(int(rng.choice([0, 5, 300]))) for _ in lengths]
        fn = fns[int(rng.integers(0, len(fns)))]
        want = byte_chain_python(tokens, lengths, parents, namespaces, bs, fn)
        assert len(want) == lengths.sum()
        assert compiled.byte_chain(tokens, lengths, parents, namespaces, bs, fn) == want
        assert byte_chain(tokens, lengths, tuple(parents), namespaces, bs, fn) == want
        # the public function converts other integer arrays first, as the twin does
        assert byte_chain(tokens.astype(">i8"), lengths, parents, namespaces, bs, fn) == want
        assert byte_chain(np.repeat(tokens, 2)[::2], lengths, parents, namespaces, bs, fn) == want
        # one segment after another: each continues from the digest before
        at, chained = 0, []
        for length, parent, ns in zip(lengths.tolist(), parents, namespaces):
            chained += byte_chain(tokens[at * bs : (at + length) * bs], np.array([length]),
                                  [parent], [ns], bs, fn)
            at += length
        assert chained == want
    ids = rng.integers(0, 32000, 100).tolist()
    assert byte_chain(
        np.array(ids[:96]), np.array([2, 4]), [ROOT_BLOCK_HASH, b""], [b"", b""], 16,
        sha256_block_hash
    )[:2] == hash_block_tokens(ids, 16)[:2]
    assert compiled.SHA256_BUILT_IN in (True, False)


# ---- the hostile fuzz --------------------------------------------------------------------
def refused(call, *inputs: object) -> None:
    """``call`` raises one of :data:`REFUSALS`, and ``inputs`` are as they were."""
    before = [np.copy(x) if isinstance(x, np.ndarray) else repr(x) for x in inputs]
    with pytest.raises(REFUSALS):
        call()
    after = [np.copy(x) if isinstance(x, np.ndarray) else repr(x) for x in inputs]
    for a, b in zip(before, after):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b


class Shrinking:
    """An ``__index__`` that empties the list holding it (Python code mid-conversion)."""

    def __init__(self, owner: list) -> None:
        self.owner = owner

    def __index__(self) -> int:
        self.owner.clear()
        return 1


class Growing(Shrinking):
    def __index__(self) -> int:
        self.owner.extend(range(100))
        return 1


class ShrinkingThenFailing(Shrinking):
    """Empties the list holding it (its only reference) and returns a float, so that Python
    raises (once its frame is gone): the error must not read the item through the list's
    dropped reference."""

    def __index__(self) -> int:
        self.owner.clear()
        return 1.5  # type: ignore[return-value]  # noqa: PLE0305 (the point)


class Swapping(Shrinking):
    """Replaces the other lists of the batch holding it by longer ones."""

    def __index__(self) -> int:
        for i in range(len(self.owner)):
            self.owner[i] = list(range(50))
        return 1


class Failing:
    def __index__(self) -> int:
        raise ValueError("no index here")


class IntList(list):
    def __iter__(self):
        return iter([0] * len(self))


BAD_ITEMS = [
    2.5,
    None,
    "1",
    b"1",
    np.float64(1.0),
    np.float32(2.0),
    np.array([1]),
    np.array(1.0),
    np.bool_(True),
    [1],
    1j,
    object(),
    2**63,
    I64_MIN - 1,
    2**200,
    -(2**200),
    np.uint64(2**63),
    Index(2**63),
    Index(-(2**70)),
    Failing(),
]


def test_int64_from_ints_refuses_hostile_input() -> None:
    for values in (
        range(3),
        iter([1, 2]),
        np.arange(3),
        np.array([1, 2], dtype=object),
        {1, 2},
        {1: 2},
        "12",
        b"12",
        bytearray(b"12"),
        None,
        5,
        IntList([1, 2]),
        memoryview(b"12"),
    ):
        refused(lambda: compiled.int64_from_ints(values, "ids"))
    with pytest.raises(TypeError):
        compiled.int64_from_ints([1, 2], None)
    with pytest.raises(TypeError):
        compiled.int64_from_ints([1, 2], 5)
    for bad in BAD_ITEMS:
        for at in (0, 3, 299):
            values = list(range(300))
            values[at] = bad
            for seq in (values, tuple(values)):
                with pytest.raises((TypeError, OverflowError, ValueError)) as info:
                    compiled.int64_from_ints(seq, "ids")
                if info.type is not ValueError:  # (Failing's own error, passed through)
                    assert f"ids must hold int64 token ids: item {at} " in str(info.value)
                assert list(seq) == values
    for kind in (Shrinking, Growing):
        values: list[object] = list(range(100))
        values[50] = kind(values)
        with pytest.raises(RuntimeError, match="ids changed size"):
            compiled.int64_from_ints(values, "ids")
    values = list(range(100))
    values[50] = ShrinkingThenFailing(values)
    with pytest.raises(TypeError, match="item 50 is a ShrinkingThenFailing: __index__ returned"):
        compiled.int64_from_ints(values, "ids")


def test_int64_from_int_lists_refuses_hostile_input() -> None:
    for lists in (
        range(3),
        iter([[1]]),
        np.zeros((2, 2), np.int64),
        None,
        [[1]].__iter__(),
        {0: [1]},
    ):
        refused(lambda: compiled.int64_from_int_lists(lists, "token_ids"))
    # items of other kinds: left to the caller, nothing converted
    for item in (np.arange(3), True, np.int64(4), IntList([1]), (x for x in [1]), None, 2.0):
        assert compiled.int64_from_int_lists([[1, 2], item], "token_ids") is None
    for bad in BAD_ITEMS:
        lists = [[1, 2], list(range(10)), (3,)]
        lists[1][7] = bad
        want = "token_ids\\[1\\] must hold int64 token ids: item 7 "
        with pytest.raises(
            (TypeError, OverflowError, ValueError), match=None if isinstance(bad, Failing) else want
        ):
            compiled.int64_from_int_lists(lists, "token_ids")
    for big in (2**63, I64_MIN - 1, 2**300):
        with pytest.raises(OverflowError, match=r"token_ids\[2\]"):
            compiled.int64_from_int_lists([[1], 2, big], "token_ids")
    # lists that an item's __index__ changes while the batch is converted
    for kind in (Shrinking, Growing, ShrinkingThenFailing):
        lists = [[0] * 10, [0] * 10]
        lists[0][5] = kind(lists[0])
        with pytest.raises((RuntimeError, TypeError), match="changed|__index__ returned"):
            compiled.int64_from_int_lists(lists, "token_ids")
    outer: list[object] = [[1, 2], [3, 4], [5, 6]]
    outer[0] = [Swapping(outer), 1]
    with pytest.raises(RuntimeError, match="changed"):
        compiled.int64_from_int_lists(outer, "token_ids")
    outer = [[1], [2], [3]]
    outer[0] = [Shrinking(outer)]
    with pytest.raises(RuntimeError, match="changed"):
        compiled.int64_from_int_lists(outer, "token_ids")


def test_byte_chain_refuses_hostile_input() -> None:
    tokens = np.arange(64, dtype=np.int64)
    lengths = np.array([1, 3], np.int64)
    good = [tokens, lengths, [ROOT_BLOCK_HASH, b"p"], [b"ns", b""], 16, sha256_block_hash]

    def call(i: int, value: object):
        args = list(good)
        args[i] = value
        return lambda: compiled.byte_chain(*args)

    for arr, i in ((tokens, 0), (lengths, 1)):
        for bad in (
            arr.view(np.float64),
            arr.view(np.uint64),
            arr.astype(">i8"),
            np.repeat(arr, 2)[::2],
            arr.reshape(2, -1),
            arr.astype(object),
            arr.astype(np.int32),
            np.array(5, np.int64),
            arr.tolist(),
            None,
        ):
            refused(call(i, bad), tokens, lengths)
    for bad_lengths in ([1, 2], [4, 1], [-1, 5], [5, -1], [2**62, 2**62], [0, 0]):
        refused(call(1, np.array(bad_lengths, np.int64)), tokens, lengths)
    refused(call(0, tokens[:63]), tokens, lengths)  # not whole blocks
    for value in (0, -16, 17, 2**62, 2**63, I64_MIN, 2.0, None):
        refused(call(4, value), tokens, lengths)
    for i in (2, 3):
        for bad in ("x", b"xy", None, [b""], [b"", b"", b""], [b"", "x"], [b"", bytearray(2)],
                    [memoryview(b""), b""], iter([b"", b""]), {b"": 1, b"x": 2}):
            refused(call(i, bad), tokens, lengths)
    for bad_fn in (None, "sha256", 5):
        refused(call(5, bad_fn), tokens, lengths)
    for digest in ("x", bytearray(32), None, 7, memoryview(bytes(32))):
        refused(call(5, lambda d: digest), tokens, lengths)
    with pytest.raises(ZeroDivisionError):  # the callable's own error is passed through
        compiled.byte_chain(tokens, lengths, [b"", b""], [b"", b""], 16, lambda d: 1 // 0)
    # a hash_fn that empties the caller's lists: the call reads its own copies
    parents, namespaces = [b"", b""], [b"", b""]

    def clearing(data: bytes) -> bytes:
        parents.clear()
        namespaces.clear()
        return hashlib.md5(data).digest()

    want = byte_chain_python(tokens, lengths, [b"", b""], [b"", b""], 16, clearing)
    parents, namespaces = [b"", b""], [b"", b""]
    assert compiled.byte_chain(tokens, lengths, parents, namespaces, 16, clearing) == want
    # the public function and its twin refuse the same inputs
    for fn in (byte_chain, byte_chain_python):
        refused(lambda: fn(tokens, np.array([5]), [b""], [b""], 16, sha256_block_hash), tokens)
        refused(lambda: fn(tokens, np.array([4]), [b""], [b""], 0, sha256_block_hash), tokens)
        refused(lambda: fn(tokens, np.array([4]), [b""], [b""], 16, bytearray), tokens)
        refused(lambda: fn(tokens, np.array([4]), [""], [b""], 16, sha256_block_hash), tokens)
        refused(lambda: fn(tokens, np.array([4]), [b""], [b"", b""], 16, sha256_block_hash),
                tokens)
    # read-only inputs are fine (only read)
    frozen, frozen_lengths = tokens.copy(), lengths.copy()
    frozen.flags.writeable = frozen_lengths.flags.writeable = False
    assert compiled.byte_chain(frozen, frozen_lengths, *good[2:]) == byte_chain_python(
        tokens, lengths, *good[2:]
    )


@pytest.mark.parametrize("seed", range(3))
def test_token_rows_compiled_and_python_agree(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal-length lists become one [n, k] array (ints: k = 1) with the compiled part and
    without it; anything else (lengths that differ, other kinds, an id out of range) is None."""
    rng = np.random.default_rng(seed)
    cases: list[list] = []
    for _ in range(40):
        n, k = int(rng.integers(1, 9)), int(rng.integers(0, 6))
        rows = rng.integers(I64_MIN, I64_MAX, (n, k), endpoint=True).tolist()
        kind = int(rng.integers(0, 6))
        if kind == 1:
            rows = [tuple(r) for r in rows]
        elif kind == 2:
            rows = [r[0] if r else 7 for r in rows]  # ints, one token each
        elif kind == 3 and n > 1:
            rows[-1] = rows[-1] + [1]  # a longer one
        elif kind == 4:
            rows[0] = np.array(rows[0], dtype=np.int64)  # not a list
        elif kind == 5 and k:
            rows[-1][0] = 2**63  # out of range
        cases.append(rows)
    results = []
    for mode in ("compiled", "python"):
        if mode == "python":
            monkeypatch.setattr(_compiled_loader, "COMPILED", None)
        results.append([token_rows(rows) for rows in cases])
    for rows, got, want in zip(cases, *results):
        if want is None:
            assert got is None
            continue
        ints = [[r] if type(r) is int else list(r) for r in rows]
        assert got.dtype == np.int64 and got.tolist() == want.tolist() == ints
