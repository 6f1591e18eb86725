"""The prefill side: compute prompts, offer them, send the blocks the decode side asks for.

Each round: one engine step; requests whose prompt is done (first token sampled) leave the
scheduler but keep their blocks; they are offered to the decode side, which answers with the
chunk rows it lacks, in order. Those rows of every layer are gathered into one buffer and sent
in one operation. A request's blocks are freed (its full blocks stay in the prefix cache) only
once the decode side acknowledges the receive, refuses the request, or is lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from blocktable.engine import LLMEngine, Request, RequestStatus
from blocktable.transfer.buffers import StagingBuffer, chunk_view
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout
from blocktable.transfer.messages import (
    Ack,
    DataHeader,
    Offer,
    OfferBatch,
    PlanBatch,
    PlanStatus,
    Round,
)
from blocktable.transfer.plan import chunk_tokens_of
from blocktable.transfer.transfer_errors import PeerLostError
from blocktable.transfer.transport import Transport


@dataclass
class PrefillStats:
    """What the prefill side did, by request id."""

    sent: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # request -> the decode side's reason
    failed: list[str] = field(default_factory=list)  # gathers that failed (recomputed there)
    num_waits: int = 0  # offers the decode side asked to repeat later
    send_time_s: float = 0.0  # gathers and sends, overlapped


class PrefillWorker:
    """Wraps an :class:`LLMEngine` that only prefills; talks to one decode side.

    Parameters
    ----------
    engine : LLMEngine
        The prefill engine (its allocator, table and KV cache).
    transport : Transport
        The wire to the decode side.
    piece_bytes : int
        The send buffer goes out in pieces of about this size, each gathered while the one
        before travels (:class:`~blocktable.transfer.buffers.StagingBuffer`).
    """

    role = "prefill"

    def __init__(self, engine: LLMEngine, transport: Transport,
                 piece_bytes: int = 16 << 20) -> None:
        self.engine = engine
        self.transport = transport
        self.staging = StagingBuffer(piece_bytes)  # the send buffer, reused every round
        self.layout = KVCacheLayout.of_cache(engine.model.kv_cache, engine.config.block_size)
        self.remote: KVCacheLayout | None = None
        self.pending: list[Request] = []  # prompt done, blocks held, not yet sent
        self.max_new_tokens: dict[str, int] = {}
        self._offers: dict[str, Offer] = {}  # made once: a waiting request is offered again
        self.stats = PrefillStats()

    def submit(self, req_id: str, prompt_token_ids: Sequence[int], max_new_tokens: int) -> None:
        """Queue a request; its decode runs on the decode side.

        Raises
        ------
        ValueError
            ``max_new_tokens < 2`` (one token needs no decode side), or what
            :meth:`LLMEngine.add_request` refuses.
        """
        if max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 for a disaggregated request (the "
                             f"prefill side samples the first), got {max_new_tokens}")
        # Two tokens keep the request running after its first: it leaves the scheduler by hand.
        self.engine.add_request(req_id, prompt_token_ids, max_new_tokens=2)
        self.max_new_tokens[req_id] = max_new_tokens

    def run(self) -> PrefillStats:
        """Handshake, then prefill and transfer until every submitted request is handed over
        (or refused); finally tell the decode side that nothing more comes."""
        self.remote = handshake(self.transport, self.layout, "prefill", "decode")
        try:
            while True:
                if self.engine.has_unfinished():
                    self.engine.step()
                self._collect_prefilled()
                done = not self.engine.has_unfinished() and not self.pending
                offered = list(self.pending)
                self.transport.send_message(
                    Round(OfferBatch.of([self._offer(r) for r in offered]), done))
                if done:
                    return self.stats
                self._transfer_round(offered)
        except PeerLostError:
            self._release(list(self.pending))  # the decode side is gone: nothing leaks here
            raise

    def _collect_prefilled(self) -> None:
        """Take requests whose prompt is done out of the scheduler (blocks kept)."""
        scheduler = self.engine.scheduler
        for req in list(scheduler.running):
            if req.output_token_ids:
                scheduler.running.remove(req)
                self.pending.append(req)

    def _offer(self, req: Request) -> Offer:
        offer = self._offers.get(req.req_id)
        if offer is None:
            offer = self._offers[req.req_id] = Offer(
                req.req_id, np.asarray(req.prompt_token_ids, dtype=np.int64),
                req.output_token_ids[0], self.max_new_tokens[req.req_id],
                np.asarray(self.engine.manager.block_ids(req.req_id)[0], dtype=np.int32))
        return offer

    def _transfer_round(self, offered: list[Request]) -> None:
        plans: PlanBatch = self.transport.recv_message()
        to_send = [r for r, st in zip(offered, plans.statuses) if st == PlanStatus.SEND]
        for i, (req, status) in enumerate(zip(offered, plans.statuses)):
            if status == PlanStatus.REFUSED:
                self.stats.refused[req.req_id] = plans.reasons.get(i, "")
                self._release([req])
            elif status == PlanStatus.WAIT:
                self.stats.num_waits += 1
        if not to_send:
            return
        assert self.remote is not None
        chunk_tokens = chunk_tokens_of(self.layout.block_size, self.remote.block_size)
        try:
            pieces = self._gather(plans.src_rows, chunk_tokens)
            view = chunk_view(self.engine.model.kv_cache, chunk_tokens)
            header = DataHeader(tuple(r.req_id for r in to_send), (),
                                self.staging.rows_per_piece(view))
        except Exception:  # noqa: BLE001 - the decode side recomputes; we free the blocks
            pieces, header = None, DataHeader((), tuple(r.req_id for r in to_send))
        self.transport.send_message(header)
        if pieces is not None:
            t0 = time.perf_counter()
            self.transport.send_tensors(pieces)
            self.stats.send_time_s += time.perf_counter() - t0
            ack: Ack = self.transport.recv_message()
            self.stats.sent += list(ack.received)
        self.stats.failed += list(header.failed)
        self._release(to_send)

    def _gather(self, rows: np.ndarray, chunk_tokens: int) -> Iterator[torch.Tensor]:
        """Every layer's K and V of ``rows``, piece after piece of the send buffer (checked
        at the call; each piece gathered in one launch when the transport asks for it)."""
        return self.staging.gather(self.engine.model.kv_cache, rows, chunk_tokens)

    def _release(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.pending.remove(req)
            self._offers.pop(req.req_id, None)
            self.engine.manager.free(req.req_id)  # full blocks stay in the prefix cache
            req.status = RequestStatus.FINISHED
