"""Disaggregation in one process: the chunk mapping against the slot formula, the gather and
scatter, the handshake, and whole runs over an in-memory transport pair (threads)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama
from blocktable.transfer import (
    DecodeWorker,
    HandshakeError,
    KVCacheLayout,
    PeerLostError,
    PrefillWorker,
    TorchDistributedTransport,
    chunk_rows,
    chunk_rows_many,
    chunk_tokens_of,
    handshake,
    local_pair,
)
from blocktable.transfer.buffers import (
    StagingBuffer,
    chunk_view,
    default_piece_bytes,
    gather_chunks,
    scatter_chunks,
)
from blocktable.transfer.kv_handshake import PROTOCOL_VERSION
from blocktable.transfer.messages import OfferBatch, PlanBatch
from blocktable.transfer.plan import leading_masks, slots_reference
from blocktable.transfer.prompt_arena import PromptArena
from blocktable.transfer.wire_format import (
    BULK_ITEMS,
    HEADER_LEN,
    MessageWriter,
    bulk_arrays,
    check_header,
    decode_message,
    encode_message,
    register_message,
)

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture(scope="module")
def workload() -> list[Any]:
    return make_workload(6, block_size=4, max_new_tokens=MAX_NEW_TOKENS)


def _engine(model: Any, block_size: int, num_blocks: int = 64, max_num_reqs: int = 8) -> LLMEngine:
    return LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=num_blocks,
                                         max_num_reqs=max_num_reqs, token_budget=32,
                                         max_model_len=64))


@pytest.fixture(scope="module")
def single_tokens(model: Any, workload: list[Any]) -> dict[str, list[int]]:
    engine = _engine(model, 4)
    run_workload(engine, workload)
    return {r.req_id: r.output_token_ids for r in engine.requests.values()}


# ------------------------------------------------------------------ the mapping
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(0, 40),
       st.integers(0, 2**31 - 1))
def test_chunk_rows_cover_the_slots_of_both_sides(ka: int, kb: int, scale: int, num_tokens: int,
                                                  seed: int) -> None:
    """Row r of chunk c holds the slots the slot formula gives each of c's tokens, on both
    sides, for any two block sizes (prefix hits start at a block boundary of the receiver)."""
    rng = np.random.default_rng(seed)
    bs_a, bs_b = ka * scale * 2, kb * scale
    chunk = chunk_tokens_of(bs_a, bs_b)
    first = int(rng.integers(0, 4)) * bs_b
    end = first + num_tokens
    for bs in (bs_a, bs_b):
        if first % chunk:
            continue
        ids = rng.permutation(np.arange(1, 64))[: -(-end // bs) or 1]
        rows = chunk_rows(ids, bs, chunk, first, num_tokens)
        positions = list(range(first, end))
        want = slots_reference(ids.tolist(), bs, positions)
        got = [int(rows[(p - first) // chunk]) * chunk + (p - first) % chunk for p in positions]
        assert got == want


def test_chunk_rows_refuse_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="block_ids holds 1 blocks of 4 tokens"):
        chunk_rows([3], 4, 4, 0, 5)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_rows([3, 4], 4, 3, 0, 5)
    with pytest.raises(ValueError, match=r"which must be >= 0 \(got \[-4\]\)"):
        chunk_rows([3, 4], 4, 4, -4, 4)  # would read the block before the request's
    with pytest.raises(ValueError, match="2 blocks per row is too narrow for 3 blocks"):
        chunk_rows_many(np.zeros((2, 2), np.int32), np.array([1]), np.array([3]), 4, 4, None,
                        np.array([12]))
    with pytest.raises(ValueError, match="block_starts must give each request's row"):
        chunk_rows_many(np.zeros((2, 2), np.int32), None, np.array([2]), 4, 4, None,
                        np.array([8]))


def test_gather_then_scatter_moves_every_layer_of_the_chosen_chunks() -> None:
    src = torch.randn(3, 2, 6, 4, 2, 5)
    dst = torch.zeros(3, 2, 10, 2, 2, 5)  # block size 2 on the receiving side
    src_rows = np.array([5, 1, 2])  # chunks of 2 tokens: block 2's second half, block 0's...
    dst_rows = np.array([7, 3, 9])
    buffer = gather_chunks(src, src_rows, 2)
    assert buffer.is_contiguous() and buffer.shape == (6, 3, 2 * 2 * 5)
    scatter_chunks(dst, dst_rows, 2, buffer)
    flat_src, flat_dst = src.view(3, 2, 24, 2, 5), dst.view(3, 2, 20, 2, 5)
    for s, d in zip(src_rows, dst_rows):
        assert torch.equal(flat_dst[:, :, 2 * d : 2 * d + 2], flat_src[:, :, 2 * s : 2 * s + 2])
    untouched = [r for r in range(10) if r not in dst_rows]
    assert not flat_dst.view(3, 2, 10, 2, 2, 5)[:, :, untouched].any()
    with pytest.raises(ValueError, match="rows must lie in"):
        gather_chunks(src, np.array([12]), 2)
    with pytest.raises(ValueError, match="buffer must be"):
        scatter_chunks(dst, dst_rows[:2], 2, buffer)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 12), st.integers(1, 400), st.sampled_from([torch.float32, torch.bfloat16]),
       st.integers(0, 2**31 - 1))
def test_pieces_gathered_sent_and_scattered_equal_one_buffer(num_rows: int, piece_bytes: int,
                                                             dtype: torch.dtype,
                                                             seed: int) -> None:
    """Any piece size: the staging buffer's pieces, laid end to end, are the one-buffer
    gather, and scattering them piece by piece writes what one scatter writes."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(2, 2, 7, 4, 2, 3, generator=gen).to(dtype)  # 14 chunks of 2 tokens
    rng = np.random.default_rng(seed)
    rows = rng.permutation(14)[:num_rows]
    dst_rows = rng.permutation(14)[:num_rows]
    whole = gather_chunks(src, rows, 2)
    staging = StagingBuffer(piece_bytes)
    pieces = list(staging.gather(src, rows, 2))
    assert all(p.is_contiguous() for p in pieces)
    got = torch.cat(pieces, dim=1) if pieces else whole
    assert torch.equal(got, whole)
    one, by_piece = torch.zeros_like(src), torch.zeros_like(src)
    scatter_chunks(one, dst_rows, 2, whole)

    def receive(outs: list[torch.Tensor]) -> Iterator[int]:  # as a transport lands them
        assert [o.shape[1] for o in outs] == [p.shape[1] for p in pieces]
        for k, (out, sent) in enumerate(zip(outs, pieces)):
            out.copy_(sent)
            yield k

    rows_per_piece = staging.rows_per_piece(chunk_view(src, 2))
    StagingBuffer(piece_bytes).scatter(by_piece, dst_rows, 2, rows_per_piece, receive)
    assert torch.equal(one, by_piece)
    if num_rows:  # a bad row is refused before anything is received
        with pytest.raises(ValueError, match=r"rows must lie in \[0, 14\)"):
            StagingBuffer(piece_bytes).scatter(by_piece, dst_rows + 14, 2, rows_per_piece,
                                               receive)


def test_the_default_pieces_are_one_on_the_cpu_and_64_mib_on_a_gpu(model: Any) -> None:
    assert default_piece_bytes("cuda") == 64 << 20 == default_piece_bytes(torch.device("cuda:1"))
    worker = PrefillWorker(_engine(model, 4), local_pair()[0])
    view = chunk_view(torch.empty(32, 2, 1 << 14, 16, 8, 128, dtype=torch.bfloat16,
                                  device="meta"), 16)  # 32 GiB of chunks, never allocated
    assert worker.staging.rows_per_piece(view) >= view.shape[1]  # all of them in one piece


def test_staging_buffer_is_reused_and_refuses_bad_sizes() -> None:
    src = torch.randn(2, 2, 4, 2, 1, 4)
    staging = StagingBuffer(1 << 20)
    (first,) = staging.gather(src, np.array([3, 1]), 2)
    (again,) = staging.gather(src, np.array([0]), 2)
    assert again.data_ptr() == first.data_ptr()  # no fresh memory per round
    with pytest.raises(ValueError, match="piece_bytes must be >= 1"):
        StagingBuffer(0)
    with pytest.raises(ValueError, match="rows must lie in"):
        staging.gather(src, np.array([0, 8]), 2)  # refused at the call, before any piece
    with pytest.raises(ValueError, match="out must be a contiguous"):
        gather_chunks(src, np.array([1]), 2, out=torch.empty(4, 2, 8))


def _through_the_wire(obj: Any) -> Any:
    header, body, bulk = encode_message(obj)
    landed = np.empty(check_header(header), dtype=np.uint8)  # as the receiver lands it
    landed[:] = body
    return decode_message(header.copy(), landed, [a.copy() for a in bulk])


def test_messages_cross_the_wire_format_with_their_arrays() -> None:
    tokens = np.array([1, 2, 3, 9, 4, 8])
    tokens.flags.writeable = False  # as a view of the prompts' buffer may be
    batch = OfferBatch(("a", "b"), tokens, np.array([0, 4, 6]), np.array([3, 5]))
    got = _through_the_wire(batch)
    for name in ("token_ids", "token_starts", "max_new_tokens"):
        mine, theirs = getattr(batch, name), getattr(got, name)
        assert theirs.dtype == mine.dtype and np.array_equal(theirs, mine), name
    assert got.req_ids == ("a", "b") and got.done is False
    assert got.first_tokens.tolist() == [9, 8] and got.prompt(1).tolist() == [4]
    assert got.num_prompt_tokens.tolist() == [3, 1]
    empty = _through_the_wire(OfferBatch.empty(True))
    assert len(empty) == 0 and empty.done
    plan = _through_the_wire(PlanBatch(np.array([0, 2], np.int8), np.array([4, 0]),
                                       {1: "never fits"}, 3))
    assert plan.reasons == {1: "never fits"} and plan.num_acked == 3
    assert plan.num_hit.tolist() == [4, 0] and plan.statuses.tolist() == [0, 2]


def test_a_writer_reuses_its_buffer_and_each_message_decodes() -> None:
    """One writer's messages share its memory (no fresh pages per round); each decodes to
    what was sent, a large one after a small one and a small one after a large one."""
    writer = MessageWriter()
    rng = np.random.default_rng(3)
    first_body = None
    for n in (2, 300, 1, 40):
        tokens = rng.integers(0, 1000, 5 * n)
        batch = OfferBatch(tuple(map(str, range(n))), tokens, np.arange(0, 5 * n + 1, 5),
                           np.full(n, 7), done=n == 1)
        header, body, bulk = writer.encode(batch)
        if n == 300:
            first_body = body
        elif first_body is not None:
            assert np.shares_memory(body, first_body)  # grown once, then reused
        got = decode_message(header.copy(), body.copy(), bulk)
        assert got.req_ids == batch.req_ids and got.done == (n == 1)
        assert np.array_equal(got.token_ids, tokens)


@pytest.mark.parametrize(("field", "change", "shown"), [
    ("token_starts", np.array([0, 4]), "token_starts holds 2 entries, 3 expected"),
    ("max_new_tokens", np.array([3, 5, 7]), "max_new_tokens holds 3 entries, 2 expected"),
    ("token_ids", np.array([1, 2, 3]), "token_ids holds 3 entries, 6 expected"),
    ("stop_starts", np.array([0, 1]), "stop_starts holds 2 entries, 3 expected"),
    ("stop_token_ids", np.array([7]), "stop_token_ids holds 1 entries, 3 expected"),
    ("stop_starts", None, "stop_token_ids holds 3 entries, 0 expected"),
])
def test_a_malformed_offer_batch_is_refused_naming_the_field(field: str, change: Any,
                                                             shown: str) -> None:
    fields = {"token_ids": np.array([1, 2, 3, 9, 4, 8]), "token_starts": np.array([0, 4, 6]),
              "max_new_tokens": np.array([3, 5]), "stop_token_ids": np.array([7, 2, 5]),
              "stop_starts": np.array([0, 1, 3])}
    header, body, _ = encode_message(OfferBatch(("a", "b"), **{**fields, field: change}))
    with pytest.raises(ValueError, match=f"malformed OfferBatch of 2 requests: {shown}"):
        decode_message(header, body)
    with pytest.raises(ValueError, match="malformed OfferBatch of 2 requests: 2 arrays, 5"):
        OfferBatch.from_wire(list(fields.values())[:2], ["a", "b"])


def test_stop_tokens_travel_with_their_requests() -> None:
    """Each request's stop tokens, packed by the prompts' arena and through the wire; none
    at all is no array."""
    stops = [frozenset({7, 2}), frozenset(), frozenset({5})]
    arena = PromptArena()
    for req_id, stop in zip("abc", stops):
        arena.add(req_id, [1], 3, stop)
    batch = OfferBatch(("a", "b", "c"), *arena.offer_arrays(["a", "b", "c"], [4, 5, 6]))
    assert batch.stop_token_ids.tolist() == [2, 7, 5]
    assert batch.stop_starts is not None and batch.stop_starts.tolist() == [0, 2, 2, 3]
    got = _through_the_wire(batch)
    assert got.stops() == stops and got.stops(np.array([2, 0])) == [stops[2], stops[0]]
    arena = PromptArena()
    arena.add("a", [1])
    none_ids, none_starts = arena.offer_arrays(["a"], [2])[3:]
    assert none_ids.size == 0 and none_starts is None
    plain = _through_the_wire(OfferBatch(("a", "b", "c"), np.arange(6),
                                         np.array([0, 2, 4, 6]), np.array([3, 4, 5]),
                                         done=True))
    assert plain.stop_starts is None and plain.stops() == [frozenset()] * 3


def test_a_malformed_plan_is_refused_naming_the_field() -> None:
    header, body, _ = encode_message(PlanBatch(np.zeros(3, np.int8), np.zeros(2, np.int64), {}))
    with pytest.raises(ValueError, match="malformed PlanBatch of 3 offers: num_hit holds 2 "
                                         "entries, 3 expected"):
        decode_message(header, body)
    with pytest.raises(ValueError, match="malformed PlanBatch: 1 arrays, 3 expected"):
        PlanBatch.from_wire([np.zeros(3, np.int8)], [], 0)


_RANDOM_DTYPES = ["<i8", "<i4", "i1", "<u2", "<u4", ">i4", ">i8"]


def _random_message_class(kind: int, num_arrays: int) -> type:
    """A registered message of ``num_arrays`` integer arrays (and strings, and one integer)."""

    @register_message(kind)
    @dataclass(frozen=True)
    class Random:
        WIRE_NUM_ARRAYS = num_arrays

        arrays: tuple[np.ndarray, ...]
        texts: tuple[str, ...]
        value: int

        def to_wire(self) -> tuple[tuple[np.ndarray, ...], tuple[str, ...], int]:
            return self.arrays, self.texts, self.value

        @classmethod
        def from_wire(cls, arrays: list[np.ndarray], texts: list[str], value: int) -> Any:
            return cls(tuple(arrays), tuple(texts), value)

    return Random


_RANDOM_CLASSES = [_random_message_class(100 + k, k % 5) for k in range(8)]


def test_the_wire_format_on_random_messages() -> None:
    """Random 1-D integer arrays (several dtypes and byte orders, empty ones, strided views),
    strings (empty ones, non-ASCII) and integers come back equal, the arrays int64 views of
    the landed body or the large ones as landed; any other object travels pickled whole; a
    header that does not fit its body is refused."""
    rng = np.random.default_rng(7)
    alphabet = ["a", "é", "区", " ", "", "req-7"]
    for _ in range(80):
        cls = _RANDOM_CLASSES[int(rng.integers(len(_RANDOM_CLASSES)))]
        arrays = []
        for _ in range(cls.WIRE_NUM_ARRAYS):
            large = rng.random() < 0.2  # at least BULK_ITEMS: a send of its own
            n = int(rng.integers(2 * BULK_ITEMS, 3 * BULK_ITEMS) if large else rng.integers(0, 9))
            a = rng.integers(-100, 100, n).astype(rng.choice(_RANDOM_DTYPES))
            arrays.append(a[::2] if rng.random() < 0.3 else a)  # a strided view
        texts = tuple("".join(rng.choice(alphabet, int(rng.integers(0, 3))))
                      for _ in range(int(rng.integers(0, 4))))
        value = int(rng.integers(-2**62, 2**62))
        header, body, bulk = encode_message(cls(tuple(arrays), texts, value))
        landed = np.empty(check_header(header), dtype=np.uint8)
        landed[:] = body
        want = bulk_arrays(header)
        assert [(a.dtype, a.size) for a in bulk] == want
        landed_bulk = [np.empty(n, d) for d, n in want]  # as the receiver lands them
        for out, a in zip(landed_bulk, bulk):
            out[:] = a
        got = decode_message(header.copy(), landed, landed_bulk)
        assert got.texts == texts and got.value == value and len(got.arrays) == len(arrays)
        for mine, theirs in zip(arrays, got.arrays):
            assert theirs.dtype == np.int64 and np.array_equal(theirs, mine)
            if mine.size >= BULK_ITEMS:  # came on its own
                assert any(theirs is b for b in landed_bulk)
                sent_from_itself = any(np.shares_memory(mine, a) for a in bulk)
                # no copy unless strided or of another dtype
                assert sent_from_itself == (mine.flags.c_contiguous and mine.dtype == np.int64)
            elif theirs.size:
                assert np.shares_memory(theirs, landed)
        if bulk:
            with pytest.raises(ValueError, match="large arrays of"):
                decode_message(header.copy(), landed, landed_bulk[:-1])
            with pytest.raises(ValueError, match="large arrays of"):
                decode_message(header.copy(), landed, [a.astype(np.int32) for a in landed_bulk])
    assert _through_the_wire({"layout": [np.arange(3)], "v": 1})["v"] == 1  # pickled whole
    with pytest.raises(ValueError, match="a message header must give a body"):
        check_header(np.full(HEADER_LEN, -1, dtype=np.int64))
    two = next(c for c in _RANDOM_CLASSES if c.WIRE_NUM_ARRAYS == 2)
    header, body, _ = encode_message(two((np.arange(3), np.arange(2, dtype=np.int8)), ("a",), 1))
    with pytest.raises(ValueError, match="body must be uint8"):
        decode_message(header, body[:-1])
    bad = header.copy()
    bad[4] = 1000  # the first array's length, past the body
    with pytest.raises(ValueError, match="do not fit"):
        decode_message(bad, body)
    bad = header.copy()
    bad[4 + 2] = 1  # a length for an array the kind does not have
    with pytest.raises(ValueError, match="do not fit"):
        decode_message(bad, body)
    bad = header.copy()
    bad[3] = 2  # two strings; the body holds one
    with pytest.raises(ValueError, match="gives 2 strings, its body holds 1"):
        decode_message(bad, body)
    bad = header.copy()
    bad[1] = 99  # no such kind
    with pytest.raises(ValueError, match="unknown message kind 99"):
        decode_message(bad, body)
    for wrong in (np.zeros((2, 2), np.int64), np.zeros(2), np.zeros(2, np.uint64)):
        with pytest.raises(ValueError, match="must give 1-D integer arrays"):
            encode_message(two((wrong, np.zeros(2, np.int64)), (), 0))
    with pytest.raises(ValueError, match="gave 1 arrays, 2 expected"):
        encode_message(two((np.arange(3),), (), 0))
    with pytest.raises(ValueError, match="holds a NUL character"):
        encode_message(two((np.arange(3), np.arange(2)), ("a", "b\0c"), 0))
    with pytest.raises(ValueError, match="must be > 0 and not taken"):
        _random_message_class(100, 0)
    with pytest.raises(ValueError, match="WIRE_NUM_ARRAYS must be an int in"):
        _random_message_class(99, 7)


# ------------------------------------------------------------------ the handshake
def _both(fn_a: Any, fn_b: Any) -> tuple[Any, Any]:
    """Run two callables on two threads; return each one's result or exception."""
    out: dict[int, Any] = {}

    def call(i: int, fn: Any) -> None:
        try:
            out[i] = fn()
        except Exception as exc:  # noqa: BLE001 - compared by the caller
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i, f)) for i, f in enumerate((fn_a, fn_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a side hung"
    return out[0], out[1]


@pytest.mark.parametrize(("field", "change"), [
    ("num_layers", {"num_layers": 3}),
    ("num_kv_heads", {"num_kv_heads": 4}),
    ("head_dim", {"head_dim": 8}),
    ("dtype", {"dtype": "torch.float16"}),
    ("cache_layout", {"cache_layout": "layer,block,kv,token,kv_head,head_dim"}),
])
def test_handshake_refuses_a_mismatch_on_both_sides_naming_the_field(field: str, change: dict
                                                                     ) -> None:
    base = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "torch.float32",
            "block_size": 4, "kernel_block_size": 4}
    mine, theirs = KVCacheLayout(**base), KVCacheLayout(**{**base, **change})
    tp, td = local_pair(timeout_s=5)
    a, b = _both(lambda: handshake(tp, mine, "prefill", "decode"),
                 lambda: handshake(td, theirs, "decode", "prefill"))
    for err, local in ((a, "prefill"), (b, "decode")):
        assert isinstance(err, HandshakeError) and err.field == field
        assert f"{local} side {getattr(mine if local == 'prefill' else theirs, field)!r}" in str(err)
        other = theirs if local == "prefill" else mine
        assert repr(getattr(other, field)) in str(err)


def test_handshake_accepts_different_block_sizes_and_refuses_a_bad_kernel_block_size() -> None:
    a = KVCacheLayout(2, 2, 16, "torch.float32", 4, 4)
    b = KVCacheLayout(2, 2, 16, "torch.float32", 16, 8)
    tp, td = local_pair(timeout_s=5)
    got_a, got_b = _both(lambda: handshake(tp, a, "prefill", "decode"),
                         lambda: handshake(td, b, "decode", "prefill"))
    assert got_a == b and got_b == a
    with pytest.raises(ValueError, match=r"kernel_block_size \(3\) must divide block_size \(4\)"):
        KVCacheLayout(2, 2, 16, "torch.float32", 4, 3)


# ------------------------------------------------------------------ whole runs
def _run_pair(model: Any, workload: list[Any], prefill: LLMEngine, decode: LLMEngine,
              prefill_cls: type[PrefillWorker] = PrefillWorker, piece_bytes: int = 64 << 20,
              stops: dict[str, frozenset[int]] | None = None
              ) -> tuple[Any, Any, DecodeWorker]:
    tp, td = local_pair(timeout_s=20)
    pw, dw = prefill_cls(prefill, tp, piece_bytes), DecodeWorker(decode, td)
    for w in workload:
        pw.submit(w.req_id, w.prompt_token_ids, w.max_new_tokens,
                  (stops or {}).get(w.req_id, ()))
    ps, ds = _both(pw.run, dw.run)
    prefill.manager.check_integrity()
    decode.manager.check_integrity()
    # the prefill side holds nothing once every request moved on (cached blocks stay)
    assert prefill.manager.num_requests == 0
    assert prefill.manager.num_free_blocks() == prefill.config.num_blocks - 1
    return ps, ds, dw


@pytest.mark.parametrize(("bs_prefill", "bs_decode", "piece_bytes"),
                         [(4, 4, 64 << 20), (4, 8, 64 << 20), (8, 2, 1000), (6, 4, 1)])
def test_decode_side_matches_the_single_engine(model: Any, workload: list[Any],
                                               single_tokens: dict[str, list[int]],
                                               bs_prefill: int, bs_decode: int,
                                               piece_bytes: int) -> None:
    """Any block sizes on the two sides; the buffer in one piece or in many."""
    ps, ds, dw = _run_pair(model, workload, _engine(model, bs_prefill), _engine(model, bs_decode),
                           piece_bytes=piece_bytes)
    assert not isinstance(ds, Exception), ds
    got = {r.req_id: r.output_token_ids for r in dw.engine.requests.values()}
    assert got == single_tokens
    assert sorted(ps.sent) == sorted(single_tokens)
    moved = {t.req_id: t for t in ds.transfers}
    # shared system prompts hit the decode side's prefix cache: fewer bytes move for them
    assert any(t.num_hit_tokens > 0 for t in moved.values())
    per_token = 2 * 2 * 2 * 16 * 4
    chunk = chunk_tokens_of(bs_prefill, bs_decode)
    for w in workload:
        t = moved[w.req_id]
        num_missing = len(w.prompt_token_ids) - t.num_hit_tokens
        assert t.num_bytes == -(-num_missing // chunk) * chunk * per_token


def test_a_prompt_wholly_in_the_decode_side_cache_moves_no_rows(model: Any) -> None:
    """A prompt whose every block the decode side already caches (the same prompt, offered a
    round later) is handed over with no rows: the data's status still goes, nothing hangs,
    and it decodes what the first copy decoded."""
    prompt = tuple(range(10, 18))  # two full blocks of 4
    Req = type(make_workload(1, block_size=4, max_new_tokens=MAX_NEW_TOKENS)[0])
    workload = [Req("a", prompt, MAX_NEW_TOKENS, 0), Req("b", prompt, MAX_NEW_TOKENS, 0)]
    # one request a step on the prefill side: "b" is offered a round after "a"
    ps, ds, dw = _run_pair(model, workload, _engine(model, 4, max_num_reqs=1), _engine(model, 4))
    assert not isinstance(ds, Exception), ds
    moved = {t.req_id: t for t in ds.transfers}
    assert (moved["b"].num_hit_tokens, moved["b"].num_bytes) == (len(prompt), 0)
    assert moved["a"].num_bytes > 0 and sorted(ps.sent) == ["a", "b"]
    tokens = {r.req_id: r.output_token_ids for r in dw.engine.requests.values()}
    assert tokens["a"] == tokens["b"] and len(tokens["a"]) == MAX_NEW_TOKENS


def test_full_decode_side_makes_offers_wait_and_refuses_what_never_fits(
        model: Any, workload: list[Any], single_tokens: dict[str, list[int]]) -> None:
    # 9 usable blocks of 4 tokens: one or two requests at a time; a 40-token prompt never fits
    too_long = type(workload[0])("huge", tuple(range(40)), MAX_NEW_TOKENS, 0)
    ps, ds, dw = _run_pair(model, [*workload, too_long], _engine(model, 4),
                           _engine(model, 4, num_blocks=10))
    assert ps.num_waits > 0 and ds.num_waits == ps.num_waits
    assert list(ps.refused) == ["huge"] and ds.refused == ["huge"]
    got = {r.req_id: r.output_token_ids for r in dw.engine.requests.values()}
    assert got == single_tokens


class _FailingGather(PrefillWorker):
    """Its first gather raises (a device error, say): that batch must be recomputed."""

    failed_once = False

    def _gather(self, rows: np.ndarray, chunk_tokens: int) -> torch.Tensor:
        if not self.failed_once:
            self.failed_once = True
            raise RuntimeError("injected gather failure")
        return super()._gather(rows, chunk_tokens)


def test_failed_transfer_is_recomputed_on_the_decode_side(
        model: Any, workload: list[Any], single_tokens: dict[str, list[int]]) -> None:
    ps, ds, dw = _run_pair(model, workload, _engine(model, 4), _engine(model, 4),
                           prefill_cls=_FailingGather)
    assert ps.failed and ds.recomputed == ps.failed
    assert not set(ps.failed) & {t.req_id for t in ds.transfers}
    got = {r.req_id: r.output_token_ids for r in dw.engine.requests.values()}
    assert got == single_tokens


@pytest.mark.parametrize("prefill_cls", [PrefillWorker, _FailingGather])
def test_stop_tokens_end_requests_where_the_single_engine_ends_them(
        model: Any, workload: list[Any], single_tokens: dict[str, list[int]],
        prefill_cls: type[PrefillWorker]) -> None:
    """A request's stop tokens travel with it (and to a recompute): one stops on the decode
    side at its third token; one whose first token is a stop finishes on the prefill side,
    moving nothing; both sides' allocators check out."""
    stops = {"req0": frozenset({single_tokens["req0"][0]}),
             "req1": frozenset({single_tokens["req1"][2], 255 - single_tokens["req1"][2]})}
    single = _engine(model, 4)
    for w in workload:
        single.add_request(w.req_id, w.prompt_token_ids, w.max_new_tokens,
                           stop_token_ids=stops.get(w.req_id, ()))
    while single.has_unfinished():
        single.step()
    expected = {r.req_id: r.output_token_ids for r in single.requests.values()}
    assert len(expected["req0"]) == 1 and len(expected["req1"]) <= 3  # the stops do stop
    ps, ds, dw = _run_pair(model, workload, _engine(model, 4), _engine(model, 8),
                           prefill_cls=prefill_cls, stops=stops)
    assert not isinstance(ds, Exception), ds
    assert ps.finished == {"req0": expected["req0"]}
    assert "req0" not in dw.engine.requests and "req0" not in ps.sent + ps.failed
    got = {r.req_id: r.output_token_ids for r in dw.engine.requests.values()}
    assert {**got, **ps.finished} == expected
    assert dw.engine.requests["req1"].finish_reason == "stop"
    if prefill_cls is _FailingGather:
        assert ds.recomputed == ps.failed and "req1" in ps.failed  # its stops came along


def test_a_silent_peer_raises_naming_it_and_frees_what_it_held(model: Any,
                                                               workload: list[Any]) -> None:
    engine = _engine(model, 4)
    tp, td = local_pair(timeout_s=0.5)
    pw = PrefillWorker(engine, tp)
    pw.submit("a", workload[0].prompt_token_ids, MAX_NEW_TOKENS)
    td.send_message({"version": PROTOCOL_VERSION, "layout": KVCacheLayout.of_cache(
        engine.model.kv_cache, 4).to_dict()})  # the decode side says hello, then nothing
    with pytest.raises(PeerLostError, match=r"lost the decode side while receiving"):
        pw.run()
    engine.manager.check_integrity()
    assert engine.manager.num_requests == 0


class _ClosedSocket:
    """``torch.distributed`` as gloo behaves once the peer's socket is closed: posting a send
    or a receive raises at once."""

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None) -> Any:
        raise RuntimeError("Connection closed by peer")

    irecv = isend


def test_a_peer_gone_before_a_post_is_lost_by_name() -> None:
    """A peer that died before the send or receive was even posted is a lost peer too (what
    the callers free their blocks on), not a bare RuntimeError."""
    transport = TorchDistributedTransport(2, "decode", "cpu", timeout_s=1.0)
    transport._dist = _ClosedSocket()
    with pytest.raises(PeerLostError, match=r"^lost the decode side \(rank 2\) while sending "
                                            r"16 bytes: RuntimeError: Connection closed"):
        transport.send_tensor(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(PeerLostError, match=r"^lost the decode side \(rank 2\) while receiving "
                                            r"8 bytes"):
        transport.recv_tensor(torch.zeros(2, dtype=torch.int32))
    assert transport.bytes_sent == transport.bytes_received == 0


def test_a_plan_for_other_offers_is_a_protocol_error(model: Any) -> None:
    pw = PrefillWorker(_engine(model, 4), local_pair()[0])
    plans = PlanBatch(np.zeros(2, np.int8), np.zeros(2, np.int64), {})
    with pytest.raises(RuntimeError, match="answered 2 offers, 0 were made"):
        pw._read_plans(plans)


@pytest.mark.parametrize(("num_hit", "shown"), [
    ([2, 0], "must divide block_size .4. and every first token"),
    ([12, 0], "num_tokens must be >= 0"),
    ([-4, 0], "which must be >= 0"),
])
def test_a_plan_whose_hits_do_not_fit_the_offers_changes_nothing(
        model: Any, workload: list[Any], num_hit: list[int], shown: str) -> None:
    """The prefill side maps the plan's tokens to its rows before it hands anything over: a
    hit off a chunk boundary, past a prompt or negative is a protocol error, and the offers
    stay pending with their blocks."""
    pw = PrefillWorker(_engine(model, 4), local_pair()[0])
    pw.remote = pw.layout
    for w in workload[:2]:
        pw.submit(w.req_id, w.prompt_token_ids[:10], MAX_NEW_TOKENS)
    while len(pw.pending) < 2:
        pw.engine.step()
        pw._collect_prefilled()
    offers = pw._offer_batch()
    plans = PlanBatch(np.zeros(2, np.int8), np.array(num_hit), {})
    with pytest.raises(RuntimeError, match=f"plan does not fit the offers: .*{shown}|{shown}"):
        pw._read_plans(plans)
    assert pw.pending.req_ids == list(offers.req_ids) and not pw._unacked
    assert all(r in pw.prompts for r in offers.req_ids)
    rows = pw._read_plans(PlanBatch(np.zeros(2, np.int8), np.array([4, 0]), {}))
    table = pw.engine.table.tables[0]
    assert table is not None
    expected = [table.block_table_np[pw.engine.manager.row_of(r)][:-(-10 // 4)]
                for r in offers.req_ids]  # chunks are blocks here; the first skips one
    assert rows.tolist() == [*expected[0][1:].tolist(), *expected[1].tolist()]
    pw._acknowledged(2)
    pw.engine.manager.check_integrity()


def test_submit_refuses_a_single_token_request(model: Any) -> None:
    pw = PrefillWorker(_engine(model, 4), local_pair()[0])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 2"):
        pw.submit("a", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="req_id must not hold a NUL character"):
        pw.submit("a\0b", [1, 2, 3], 4)
    assert not pw.engine.requests and len(pw.prompts) == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30)), min_size=0, max_size=5),
       st.sampled_from([(4, 4), (8, 4), (6, 2), (12, 3)]), st.booleans(),
       st.integers(0, 2**31 - 1))
@example([(0, 8), (0, 4)], (4, 4), False, 1)  # every request's rows follow the last one's
@example([(0, 8), (0, 16)], (8, 4), False, 2)  # the same, two chunks per block
@example([(0, 8), (0, 16)], (8, 4), True, 2)  # the same with a spare block or two
@example([(1, 8), (0, 5)], (4, 4), False, 3)  # a hit: the rows start inside the request's blocks
def test_chunk_rows_many_equals_the_slot_formula_per_request(
        reqs: list[tuple[int, int]], sizes: tuple[int, int], spare: bool, seed: int) -> None:
    """The batched mapping of several requests, request by request, is the slot formula;
    also with the blocks given back to back (no starts) and, without hits, no first tokens.
    With ``spare``, requests may hold a block more than they need (a table row past the
    prompt)."""
    block_size, chunk = sizes
    rng = np.random.default_rng(seed)
    ids_per_req = [rng.permutation(np.arange(1, 100))[: -(-(f * block_size + n) // block_size)
                                                       + int(spare and rng.integers(0, 2))]
                   for f, n in reqs]
    counts = np.array([ids.size for ids in ids_per_req], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    flat = np.concatenate(ids_per_req) if reqs else np.zeros(0, np.int64)
    firsts = np.array([f * block_size for f, _ in reqs], dtype=np.int64)
    nums = np.array([n for _, n in reqs], dtype=np.int64)
    rows, num_rows = chunk_rows_many(flat, starts, counts, block_size, chunk, firsts, nums)
    assert num_rows.dtype == np.int64 and num_rows.sum() == rows.size
    assert num_rows.tolist() == [-(-n // chunk) for n in nums.tolist()]
    again = chunk_rows_many(flat, None, counts, block_size, chunk,
                            firsts if firsts.any() else None, nums)
    assert np.array_equal(again[0], rows) and np.array_equal(again[1], num_rows)
    # the same blocks leading the rows of a table (rows shuffled, junk past each request's)
    width = int(counts.max(initial=0)) + int(rng.integers(0, 3))
    table = rng.integers(0, 100, (len(reqs) + 2, width)).astype(np.int32)
    table_rows = rng.permutation(len(reqs) + 2)[:len(reqs)]
    for ids, r in zip(ids_per_req, table_rows):
        table[r, :ids.size] = ids
    again = chunk_rows_many(table, table_rows, counts, block_size, chunk,
                            firsts if firsts.any() else None, nums)
    assert np.array_equal(again[0], rows) and np.array_equal(again[1], num_rows)
    assert again[0].dtype == np.int64
    if chunk == block_size and not spare and not firsts.any():
        # whole blocks, each request holding just its tokens' (as the decode side allocates
        # them): the rows are the blocks as given, which the decode side takes without a call
        assert np.array_equal(rows, flat)
    row_starts = np.concatenate([[0], np.cumsum(num_rows)])
    for k, (ids, first, num) in enumerate(zip(ids_per_req, firsts, nums)):
        mine = rows[row_starts[k]:row_starts[k + 1]]
        positions = range(int(first), int(first + num))
        want = slots_reference(ids.tolist(), block_size, positions)
        got = [int(mine[(p - first) // chunk]) * chunk + (p - first) % chunk for p in positions]
        assert got == want


@pytest.mark.parametrize("width", [0, 1, 2, 7, 40])
def test_leading_masks_are_the_positions_below_each_count(width: int) -> None:
    """Row ``c`` of the masks ``leading_blocks`` looks up is ``arange(width) < c``, for every
    count a row of the table can hold; the masks are read-only windows of one small array."""
    masks = leading_masks(width)
    want = np.arange(width) < np.arange(width + 1)[:, None]
    assert masks.shape == want.shape and masks.dtype == np.bool_
    assert np.array_equal(masks, want)
    assert not masks.flags.writeable
    counts = np.arange(width + 1)[::-1]
    assert np.array_equal(masks[counts], want[counts])


class _FailingSomeGathers(PrefillWorker):
    """Fails the gathers of the rounds whose index is in ``fail_rounds`` (set per example)."""

    fail_rounds: frozenset[int] = frozenset()

    def _gather(self, rows: np.ndarray, chunk_tokens: int) -> torch.Tensor:
        self.num_gathers = getattr(self, "num_gathers", 0) + 1
        if self.num_gathers - 1 in self.fail_rounds:
            raise RuntimeError("injected gather failure")
        return super()._gather(rows, chunk_tokens)


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.sampled_from([2, 4, 8]), st.integers(0, 30),
       st.frozensets(st.integers(0, 6), max_size=3), st.integers(0, 1000))
def test_random_runs_match_the_single_engine_and_leak_nothing(
        model: Any, single_tokens: dict[str, list[int]], bs_prefill: int, bs_decode: int,
        extra_blocks: int, fail_rounds: frozenset[int], seed: int) -> None:
    """Any block sizes, a decode pool from just enough to roomy (offers wait), failed gathers
    in any rounds (recomputed): every request's tokens are the single engine's, and both
    allocators check out."""
    workload = make_workload(6, block_size=4, max_new_tokens=MAX_NEW_TOKENS)  # the fixture's
    longest = max(len(w.prompt_token_ids) for w in workload) + MAX_NEW_TOKENS - 1
    decode_blocks = -(-longest // bs_decode) + 1 + extra_blocks
    cls = type("Failing", (_FailingSomeGathers,), {"fail_rounds": fail_rounds})
    ps, ds, dw = _run_pair(model, workload, _engine(model, bs_prefill),
                           _engine(model, bs_decode, num_blocks=decode_blocks), prefill_cls=cls)
    assert not isinstance(ds, Exception), ds
    got = {r.req_id: r.output_token_ids for r in dw.engine.requests.values()}
    assert got == single_tokens
    assert sorted(ps.sent + ps.failed) == sorted(single_tokens)
    assert sorted(ds.recomputed) == sorted(ps.failed)


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("kernel_block_size", 3, "3, which does not divide its block_size 4"),
    ("block_size", 0, "0"),
    ("head_dim", "16", "'16'"),
])
def test_handshake_refuses_a_peer_layout_that_makes_no_sense(field: str, value: object,
                                                             shown: str) -> None:
    mine = KVCacheLayout(2, 2, 16, "torch.float32", 4, 4)
    tp, td = local_pair(timeout_s=5)
    td.send_message({"version": PROTOCOL_VERSION, "layout": {**mine.to_dict(), field: value}})
    with pytest.raises(HandshakeError) as info:
        handshake(tp, mine, "prefill", "decode")
    assert info.value.field == field
    assert f"prefill side {getattr(mine, field)!r}, decode side " in str(info.value)
    assert shown in str(info.value)
