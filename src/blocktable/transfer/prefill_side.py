"""The prefill side: compute prompts, offer them, send the blocks the decode side asks for.

Each round: one engine step; requests whose prompt is done (first token sampled) leave the
scheduler but keep their blocks; they are offered to the decode side, which answers with the
chunk rows it lacks, in order. Those rows of every layer are gathered into one staging buffer,
piece by piece, each piece sent while the next is gathered. A request's blocks are freed (its
full blocks stay in the prefix cache) only once the decode side's next plan acknowledges the
data, or it refuses the request, or it is lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from blocktable.engine import LLMEngine, Request, RequestStatus
from blocktable.transfer.buffers import StagingBuffer, chunk_view
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout
from blocktable.transfer.messages import (
    OfferBatch,
    PlanBatch,
    PlanStatus,
    Round,
    data_status,
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
                 piece_bytes: int = 64 << 20) -> None:
        self.engine = engine
        self.transport = transport
        self.staging = StagingBuffer(piece_bytes)  # the send buffer, reused every round
        self.layout = KVCacheLayout.of_cache(engine.model.kv_cache, engine.config.block_size)
        self.remote: KVCacheLayout | None = None
        self.pending: list[Request] = []  # prompt done, blocks held, not yet sent
        self._unacked: list[Request] = []  # sent, blocks held until the next plan's ack
        self.max_new_tokens: dict[str, int] = {}
        # per request, made once: its prompt with room for the first token, its table row
        self._token_ids: dict[str, np.ndarray] = {}  # on cpu, int32 [num_prompt + 1]
        self._rows: dict[str, int] = {}
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
        tokens = self._token_ids[req_id] = np.empty(len(prompt_token_ids) + 1, dtype=np.int32)
        tokens[:-1] = prompt_token_ids

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
                self.transport.send_message(Round(self._offer_batch(offered), done))
                plans: PlanBatch = self.transport.recv_message()
                self._acknowledged(plans.num_acked)
                if done:
                    return self.stats
                self._transfer_round(offered, plans)
        except PeerLostError:  # the decode side is gone: nothing leaks here
            self._release(self.pending + self._unacked)
            raise

    def _collect_prefilled(self) -> None:
        """Take requests whose prompt is done out of the scheduler (blocks kept)."""
        running = self.engine.scheduler.running
        done = [req for req in running if req.output_token_ids]
        if not done:
            return
        if len(done) == len(running):
            running.clear()
        else:
            running[:] = [req for req in running if not req.output_token_ids]
        token_ids, rows = self._token_ids, self._rows
        for req, row in zip(done, self._rows_of(done)):
            req_id = req.req_id
            token_ids[req_id][-1] = req.output_token_ids[0]
            rows[req_id] = row
        self.pending += done

    def _rows_of(self, reqs: list[Request]) -> list[int]:
        """Their table rows (the allocator's look-up, one per request)."""
        row_of = self.engine.manager.row_of
        return [row_of(req.req_id) for req in reqs]

    def _offer_batch(self, offered: list[Request]) -> OfferBatch:
        """The offers of ``offered`` as one message: the block ids are the table's rows,
        read in one pass."""
        n = len(offered)
        if not n:
            return OfferBatch.empty()
        ids = tuple([req.req_id for req in offered])
        table = self.engine.table.tables[0]
        assert table is not None
        rows = np.array([self._rows[r] for r in ids], dtype=np.int64)
        counts = table.num_kernel_blocks[rows]
        block_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=block_starts[1:])
        block_ids = table.block_table_np[rows][np.arange(table.block_table_np.shape[1])
                                               < counts[:, None]]
        tokens = [self._token_ids[r] for r in ids]
        token_starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([t.size for t in tokens], out=token_starts[1:])
        max_new = np.array([self.max_new_tokens[r] for r in ids], dtype=np.int64)
        return OfferBatch(ids, np.concatenate(tokens), token_starts, max_new, block_ids,
                          block_starts)

    def _transfer_round(self, offered: list[Request], plans: PlanBatch) -> None:
        to_send, refused = self._read_plans(offered, plans)
        self._release(refused)
        if not to_send:
            return
        assert self.remote is not None
        chunk_tokens = chunk_tokens_of(self.layout.kernel_block_size,
                                       self.remote.kernel_block_size)
        try:
            pieces = self._gather(plans.src_rows, chunk_tokens)
            view = chunk_view(self.engine.model.kv_cache, chunk_tokens)
            status = data_status(True, self.staging.rows_per_piece(view))
        except Exception:  # noqa: BLE001 - the decode side recomputes; we free the blocks
            pieces, status = iter(()), data_status(False, 0)
        device = self.engine.model.kv_cache.device
        t0 = time.perf_counter()
        self.transport.send_tensors(chain((torch.from_numpy(status).to(device),), pieces))
        self.stats.send_time_s += time.perf_counter() - t0
        if status[0]:  # freed once the next plan acknowledges them
            if len(to_send) == len(self.pending):
                self.pending = []
            else:
                sent = {id(req) for req in to_send}
                self.pending = [req for req in self.pending if id(req) not in sent]
            self._unacked = to_send
        else:
            self.stats.failed += [req.req_id for req in to_send]
            self._release(to_send)

    def _acknowledged(self, num_acked: int) -> None:
        """The decode side holds the last round's KV: free those requests' blocks here."""
        if num_acked != len(self._unacked):
            raise RuntimeError(f"protocol error: the {self.transport.peer} acknowledged "
                               f"{num_acked} requests, {len(self._unacked)} were sent")
        self.stats.sent += [req.req_id for req in self._unacked]
        self._release(self._unacked)

    def _read_plans(self, offered: list[Request], plans: PlanBatch
                    ) -> tuple[list[Request], list[Request]]:
        """The offers to send and the refused ones (recorded); waiting ones are counted."""
        statuses = plans.statuses
        send = statuses == PlanStatus.SEND
        if send.all():  # the common round: everything fits
            return offered, []
        refused = [offered[i] for i in np.flatnonzero(statuses == PlanStatus.REFUSED).tolist()]
        for req in refused:
            self.stats.refused[req.req_id] = plans.reasons.get(offered.index(req), "")
        self.stats.num_waits += int(np.count_nonzero(statuses == PlanStatus.WAIT))
        to_send = [offered[i] for i in np.flatnonzero(send).tolist()]
        return to_send, refused

    def _gather(self, rows: np.ndarray, chunk_tokens: int) -> Iterator[torch.Tensor]:
        """Every layer's K and V of ``rows``, piece after piece of the send buffer (checked
        at the call; each piece gathered in one launch when the transport asks for it)."""
        return self.staging.gather(self.engine.model.kv_cache, rows, chunk_tokens)

    def _release(self, reqs: list[Request]) -> None:
        """Free their blocks (full ones stay in the prefix cache) in one allocator call."""
        if not reqs:
            return
        ids = [req.req_id for req in reqs]
        gone = set(ids)
        if self.pending:
            self.pending = [req for req in self.pending if req.req_id not in gone]
        if self._unacked:
            self._unacked = [req for req in self._unacked if req.req_id not in gone]
        token_ids, rows = self._token_ids, self._rows
        for req_id in gone:
            del token_ids[req_id], rows[req_id]
        self.engine.manager.free_many(ids)
        for req in reqs:
            req.status = RequestStatus.FINISHED
