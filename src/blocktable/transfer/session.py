"""One process's side of a disaggregated run: build its engine, connect, run, report.

:func:`run_side` is what ``blocktable demo --disaggregate``, the tests and the benchmark spawn
on two ranks of a ``torch.distributed`` group (rank 0 prefills, rank 1 decodes by default).
Each side builds its own model from a small picklable builder (a model does not cross a
process start): the tiny random one, or a real one each side loads from its source. Nothing
below the session knows which: the handshake compares the caches the models gave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from blocktable.engine import EngineConfig, LLMEngine, WorkloadRequest
from blocktable.engine.dcp_runner import ModelBuilder, TinyLlama
from blocktable.transfer.decode_side import DecodeWorker
from blocktable.transfer.prefill_side import PrefillWorker
from blocktable.transfer.transport import TorchDistributedTransport


@dataclass(frozen=True)
class Session:
    """Everything both sides need, pickled to each.

    Attributes
    ----------
    prefill, decode : EngineConfig
        Each side's engine (block sizes and pools may differ).
    workload : tuple of WorkloadRequest
        Submitted to the prefill side at start (arrival steps are not used).
    stop_token_ids : dict
        Request id -> its stop tokens (requests not named have none); they travel to the
        decode side with the request.
    prefill_model, decode_model : ModelBuilder
        Each side's model, built in its process on its device (default the tiny random
        model, seed 0; two models whose caches differ are refused at the handshake).
    device : {"cpu", "cuda"}
        ``"cuda"``: rank ``r`` on GPU ``r`` and NCCL; ``"cpu"``: gloo.
    timeout_s : float
        Longest wait on the peer for one operation.
    prefill_rank, decode_rank : int
    prefill_cls, decode_cls : type
        The worker classes (tests pass subclasses that fail on purpose).
    piece_bytes : int or None
        The prefill side's send-buffer piece size (:class:`PrefillWorker`; ``None``: its
        default for the device).
    """

    prefill: EngineConfig
    decode: EngineConfig
    workload: tuple[WorkloadRequest, ...]
    stop_token_ids: dict[str, frozenset[int]] = field(default_factory=dict)
    prefill_model: ModelBuilder = field(default_factory=TinyLlama)
    decode_model: ModelBuilder = field(default_factory=TinyLlama)
    device: str = "cpu"
    timeout_s: float = 30.0
    prefill_rank: int = 0
    decode_rank: int = 1
    prefill_cls: type[PrefillWorker] = PrefillWorker
    decode_cls: type[DecodeWorker] = DecodeWorker
    piece_bytes: int | None = None


def build_side(rank: int, session: Session) -> PrefillWorker | DecodeWorker:
    """This rank's worker (engine, model and transport built here)."""
    if rank not in (session.prefill_rank, session.decode_rank):
        raise ValueError(f"rank {rank} is neither the prefill rank ({session.prefill_rank}) "
                         f"nor the decode rank ({session.decode_rank})")
    is_prefill = rank == session.prefill_rank
    device = torch.device(f"cuda:{rank}" if session.device == "cuda" else "cpu")
    model = (session.prefill_model if is_prefill else session.decode_model)(device)
    engine = LLMEngine(model, session.prefill if is_prefill else session.decode)
    peer_rank = session.decode_rank if is_prefill else session.prefill_rank
    transport = TorchDistributedTransport(peer_rank, "decode" if is_prefill else "prefill",
                                          device, session.timeout_s)
    if is_prefill:
        prefill = session.prefill_cls(engine, transport, session.piece_bytes)
        for w in session.workload:
            prefill.submit(w.req_id, w.prompt_token_ids, w.max_new_tokens,
                           session.stop_token_ids.get(w.req_id, ()))
        return prefill
    return session.decode_cls(engine, transport)


def run_side(rank: int, world_size: int, session: Session) -> dict[str, Any]:
    """Run this rank's side; return a JSON-able report (both sides' allocators are checked).

    The report: ``role``; on the decode side ``tokens`` (request -> generated ids),
    ``transfers`` (request, blocks, bytes, seconds, prefix-hit tokens, batch size),
    ``refused`` and ``recomputed``; on the prefill side ``sent``, ``finished`` (request ->
    its one token, a stop token: nothing moved), ``refused``, ``failed``.
    """
    worker = build_side(rank, session)
    try:
        if isinstance(worker, PrefillWorker):
            sent = worker.run()
            report: dict[str, Any] = {"role": "prefill", "sent": sent.sent,
                                      "finished": sent.finished,
                                      "refused": sent.refused, "failed": sent.failed,
                                      "num_waits": sent.num_waits}
        else:
            got = worker.run()
            report = {
                "role": "decode",
                "tokens": {r.req_id: r.output_token_ids
                           for r in worker.engine.requests.values()},
                "transfers": [[t.req_id, t.num_blocks, t.num_bytes, t.time_s, t.num_hit_tokens,
                               t.batch_size] for t in got.transfers],
                "refused": got.refused,
                "recomputed": got.recomputed,
                "num_waits": got.num_waits,
            }
    finally:  # on a lost peer too: what it held here must be freed
        worker.engine.manager.check_integrity()
    return report
