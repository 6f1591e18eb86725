"""Disaggregation between two spawned processes over gloo: the decode side's tokens equal the
single engine's, a mismatch is refused at the handshake on both sides, and a side that dies
mid-transfer makes the other raise within seconds, naming it, with nothing leaked."""

from __future__ import annotations

import json
import os
import time
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


@pytest.mark.parametrize("piece_bytes", [64 << 20, 700])
def test_two_processes_match_the_single_engine(tmp_path: Path, piece_bytes: int) -> None:
    """One buffer per round, or many pieces in flight at once over gloo."""
    session = _session(tmp_path, piece_bytes=piece_bytes)
    prefill, decode = run_ranks(run_side, 2, tmp_path, args=(session,), timeout_s=60.0)
    assert prefill["role"] == "prefill" and decode["role"] == "decode"
    assert decode["tokens"] == _single_engine_tokens()
    assert sorted(prefill["sent"]) == sorted(decode["tokens"])
    assert all(t[2] > 0 for t in decode["transfers"])  # bytes moved for every request


def test_mismatched_models_are_refused_at_the_handshake_on_both_sides(tmp_path: Path) -> None:
    session = _session(tmp_path, decode_model={"num_layers": 3})
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



def test_demo_disaggregate_transfers_and_matches(capsys: pytest.CaptureFixture[str]) -> None:
    from blocktable.cli import main

    assert main(["demo", "--disaggregate", "--num-requests", "3", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "req0: transferred " in out and "total: transferred " in out
    assert "OK: 3/3 requests decoded after a transfer match" in out


def test_demo_disaggregate_refuses_dcp(capsys: pytest.CaptureFixture[str]) -> None:
    from blocktable.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--disaggregate", "--dcp", "2"])
    assert info.value.code == 2
    assert "--disaggregate runs the tiny model without --dcp" in capsys.readouterr().err
