"""One process's side of a disaggregated run: build its engine, connect, run, report.

:func:`run_side` is what ``blocktable demo --disaggregate``, the tests and the benchmark spawn
on two ranks of a ``torch.distributed`` group (rank 0 prefills, rank 1 decodes by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from blocktable.engine import EngineConfig, LLMEngine, WorkloadRequest, tiny_llama
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
    model_seed : int
        Both sides build ``tiny_llama(seed=model_seed, **model_kwargs)``.
    prefill_model, decode_model : dict
        Extra ``tiny_llama`` arguments per side (a mismatch is refused at the handshake).
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
    model_seed: int = 0
    prefill_model: dict[str, Any] = field(default_factory=dict)
    decode_model: dict[str, Any] = field(default_factory=dict)
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
    model = tiny_llama(seed=session.model_seed, device=device,
                       **(session.prefill_model if is_prefill else session.decode_model))
    engine = LLMEngine(model, session.prefill if is_prefill else session.decode)
    peer_rank = session.decode_rank if is_prefill else session.prefill_rank
    transport = TorchDistributedTransport(peer_rank, "decode" if is_prefill else "prefill",
                                          device, session.timeout_s)
    if is_prefill:
        prefill = session.prefill_cls(engine, transport, session.piece_bytes)
        for w in session.workload:
            prefill.submit(w.req_id, w.prompt_token_ids, w.max_new_tokens)
        return prefill
    return session.decode_cls(engine, transport)


def run_side(rank: int, world_size: int, session: Session) -> dict[str, Any]:
    """Run this rank's side; return a JSON-able report (both sides' allocators are checked).

    The report: ``role``; on the decode side ``tokens`` (request -> generated ids),
    ``transfers`` (request, blocks, bytes, seconds, prefix-hit tokens, batch size),
    ``refused`` and ``recomputed``; on the prefill side ``sent``, ``refused``, ``failed``.
    """
    worker = build_side(rank, session)
    try:
        if isinstance(worker, PrefillWorker):
            sent = worker.run()
            report: dict[str, Any] = {"role": "prefill", "sent": sent.sent,
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
