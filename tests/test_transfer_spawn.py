"""Disaggregation between two spawned processes over gloo: the decode side's tokens equal the
single engine's, a mismatch is refused at the handshake on both sides, and a side that dies
mid-transfer makes the other raise within seconds, naming it, with nothing leaked."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from spawn import run_ranks

from blocktable.engine import EngineConfig, LLMEngine, make_workload, run_workload, tiny_llama
from blocktable.transfer import DecodeWorker, PrefillWorker
from blocktable.transfer.session import Session, run_side

MAX_NEW_TOKENS = 5
WORKLOAD = tuple(make_workload(5, block_size=4, max_new_tokens=MAX_NEW_TOKENS))


def _config(block_size: int, num_blocks: int = 48) -> EngineConfig:
    return EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_reqs=8,
                        token_budget=32, max_model_len=64)


def _session(tmp: Path, **kw: Any) -> Session:
    base: dict[str, Any] = {"prefill": _config(4), "decode": _config(8), "workload": WORKLOAD,
                            "timeout_s": 20.0}
    return Session(**{**base, **kw})


def survivor_job(rank: int, world: int, session: Session, out_dir: str) -> Any:
    """``run_side``, and on a failure write what this side saw (error, time)
    where the parent finds it even when the peer's death fails the whole job."""
    try:
        return run_side(rank, world, session)
    except Exception as exc:
        Path(out_dir, f"survivor{rank}.json").write_text(json.dumps({
            "error": f"{type(exc).__name__}: {exc}", "raised_at": time.time(),
        }))
        raise


@dataclass(frozen=True)
class ThreeLayers:
    """A model builder whose cache has one layer more than the default tiny model's."""

    def __call__(self, device: torch.device) -> Any:
        return tiny_llama(num_layers=3, device=device)


def _die() -> None:
    """Note the time of death where the parent finds it, then exit without any clean-up."""
    Path(os.environ["TRANSFER_TEST_DIR"], "died_at").write_text(str(time.time()))
    os._exit(17)


class DiesBeforeSending(PrefillWorker):
    """Receives the decode side's plans, then dies before the data goes out."""

    def _gather(self, rows: np.ndarray, chunk_tokens: int) -> torch.Tensor:
        _die()


class DiesBeforeAck(DecodeWorker):
    """Receives the first buffer and acknowledges it, then dies before decoding."""

    def _start_decoding(self, plan: Any) -> None:
        _die()


def _single_engine_tokens() -> dict[str, list[int]]:
    engine = LLMEngine(tiny_llama(), _config(4))
    run_workload(engine, WORKLOAD)
    return {r.req_id: r.output_token_ids for r in engine.requests.values()}


PIECE_BYTES = (64 << 20, 700)


def sessions_in_turn(rank: int, world: int, sessions: list[Session]) -> list[dict[str, Any]]:
    """``run_side`` for each session in turn on the same two ranks (one process start each)."""
    return [run_side(rank, world, session) for session in sessions]


@pytest.fixture(scope="module")
def piece_size_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """Both piece sizes' sessions, one after the other on one pair of spawned ranks."""
    tmp = tmp_path_factory.mktemp("pieces")
    sessions = [_session(tmp, piece_bytes=b) for b in PIECE_BYTES]
    prefill, decode = run_ranks(sessions_in_turn, 2, tmp, args=(sessions,), timeout_s=90.0)
    return {b: (prefill[i], decode[i]) for i, b in enumerate(PIECE_BYTES)}


@pytest.mark.parametrize("piece_bytes", PIECE_BYTES)
def test_two_processes_match_the_single_engine(piece_size_reports: dict[int, Any],
                                               piece_bytes: int) -> None:
    """One buffer per round, or many pieces in flight at once over gloo."""
    prefill, decode = piece_size_reports[piece_bytes]
    assert prefill["role"] == "prefill" and decode["role"] == "decode"
    assert decode["tokens"] == _single_engine_tokens()
    assert sorted(prefill["sent"]) == sorted(decode["tokens"])
    assert all(t[2] > 0 for t in decode["transfers"])  # bytes moved for every request


def test_mismatched_models_are_refused_at_the_handshake_on_both_sides(tmp_path: Path) -> None:
    session = _session(tmp_path, decode_model=ThreeLayers())
    with pytest.raises(AssertionError) as info:
        run_ranks(run_side, 2, tmp_path, args=(session,), timeout_s=60.0)
    text = str(info.value)
    assert "rank 0:" in text and "rank 1:" in text
    assert "num_layers differs (prefill side 2, decode side 3)" in text
    assert "num_layers differs (decode side 3, prefill side 2)" in text


@pytest.mark.parametrize(("dying", "cls_field", "cls", "survivor", "peer"), [
    (0, "prefill_cls", DiesBeforeSending, 1, "prefill side (rank 0)"),
    (1, "decode_cls", DiesBeforeAck, 0, "decode side (rank 1)"),
])
def test_a_side_that_dies_mid_transfer_is_named_within_seconds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dying: int, cls_field: str, cls: type,
        survivor: int, peer: str) -> None:
    session = _session(tmp_path, **{cls_field: cls})
    monkeypatch.setenv("TRANSFER_TEST_DIR", str(tmp_path))  # the children inherit it
    with pytest.raises(AssertionError) as info:
        run_ranks(survivor_job, 2, tmp_path, args=(session, str(tmp_path)), timeout_s=60.0)
    assert f"rank {dying}: died (exit code 17)" in str(info.value)
    seen = json.loads((tmp_path / f"survivor{survivor}.json").read_text())
    # the survivor checked its allocator (run_side does, before re-raising) and named the peer
    assert seen["error"].startswith(f"PeerLostError: lost the {peer}"), seen
    died_at = float((tmp_path / "died_at").read_text())
    assert seen["raised_at"] - died_at < 3.0, seen  # gloo sees the closed socket at once



def _messages(seed: int) -> list[Any]:
    """Messages of every shape the framing has: a plan within the first frame, an empty one,
    a plan whose body spills past the frame, offers with large token ids (their own send),
    with long request ids (body past the frame and a large array), pickled objects small and
    large."""
    from blocktable.transfer.messages import OfferBatch, PlanBatch

    rng = np.random.default_rng(seed)

    def offer(n: int, tokens_each: int, id_len: int) -> OfferBatch:
        ids = tuple(f"{i}-" + "x" * id_len for i in range(n))
        tokens = rng.integers(0, 50_000, n * tokens_each)
        return OfferBatch(ids, tokens, np.arange(n + 1) * tokens_each, rng.integers(2, 9, n),
                          done=bool(n % 2))

    return [
        PlanBatch(rng.integers(0, 3, 5).astype(np.int8), rng.integers(0, 99, 5), {2: "é"}, 3),
        PlanBatch(np.zeros(0, np.int8), np.zeros(0, np.int64), {}, 0),
        PlanBatch(rng.integers(0, 3, 900).astype(np.int8), rng.integers(0, 99, 900),
                  {i: f"never fits {i}" for i in range(0, 900, 7)}, 11),
        offer(64, 513, 4), offer(3, 5, 2), offer(40, 400, 200),
        {"layout": list(range(3))}, {"big": "y" * 20_000},
    ]


def echo_job(rank: int, world: int) -> Any:
    """Rank 0 sends every message; rank 1 sends each back as it landed; rank 0 compares."""
    from blocktable.transfer.messages import OfferBatch, PlanBatch
    from blocktable.transfer.transport import TorchDistributedTransport

    transport = TorchDistributedTransport(1 - rank, "peer", "cpu", timeout_s=20.0)
    sent = _messages(0)
    for msg in sent:
        if rank == 1:
            transport.send_message(transport.recv_message())
            continue
        transport.send_message(msg)
        got = transport.recv_message()
        if isinstance(msg, OfferBatch):
            mine, theirs = msg, got
            assert theirs.req_ids == mine.req_ids and got.done == msg.done
            for name in ("token_ids", "token_starts", "max_new_tokens"):
                assert np.array_equal(getattr(theirs, name), getattr(mine, name)), name
        elif isinstance(msg, PlanBatch):
            assert np.array_equal(got.statuses, msg.statuses) and got.num_acked == msg.num_acked
            assert np.array_equal(got.num_hit, msg.num_hit) and got.reasons == msg.reasons
        else:
            assert got == msg
    return len(sent)


def test_every_message_shape_crosses_a_real_transport(tmp_path: Path) -> None:
    """The transport's framing (one fixed first frame, the body's rest, large arrays landing
    in reused memory) on gloo, both ways."""
    assert run_ranks(echo_job, 2, tmp_path, timeout_s=60.0) == [len(_messages(0))] * 2


def test_demo_disaggregate_transfers_and_matches(capsys: pytest.CaptureFixture[str]) -> None:
    from blocktable.cli import main

    assert main(["demo", "--disaggregate", "--num-requests", "3", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "req0: transferred " in out and "total: transferred " in out
    assert "OK: 3/3 requests decoded after a transfer match" in out
