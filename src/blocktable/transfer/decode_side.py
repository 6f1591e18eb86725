"""The decode side: take offered requests into the allocator, receive their KV, decode.

For each offer the decode side asks its allocator: a prefix hit shares cached blocks (those
tokens are not sent), then blocks for the rest of the prompt are allocated. The plan sent back
lists the prefill side's chunk rows for exactly the missing tokens, in token order; the
buffer that comes back is scattered into this side's rows (its own block ids and block size),
the tokens are marked computed and the request joins the running batch with its first token.

Out of blocks: the offer waits while running requests will free some, else it is refused.
A batch the prefill side could not gather is recomputed here from its prompt. A lost prefill
side frees every allocation of the round and raises :class:`PeerLostError`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from blocktable.engine import LLMEngine, Request, RequestStatus
from blocktable.transfer.buffers import StagingBuffer, chunk_view, scatter_chunks
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
from blocktable.transfer.plan import chunk_rows_many, chunk_tokens_of, num_blocks_touched
from blocktable.transfer.transfer_errors import PeerLostError
from blocktable.transfer.transport import Transport


@dataclass(frozen=True)
class TransferRecord:
    """One request's transfer as the decode side saw it."""

    req_id: str
    num_blocks: int  # decode-side blocks written
    num_bytes: int
    time_s: float  # its round's receive and scatter (shared by the round's requests)
    num_hit_tokens: int  # prompt tokens this side's prefix cache already held
    batch_size: int  # requests moved in the same buffer


@dataclass
class DecodeStats:
    transfers: list[TransferRecord] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)  # failed transfers, computed here
    num_waits: int = 0


class DecodeWorker:
    """Wraps an :class:`LLMEngine` that decodes requests another engine prefilled.

    Parameters
    ----------
    engine : LLMEngine
        The decode engine (its allocator, table and KV cache).
    transport : Transport
        The wire to the prefill side.
    """

    role = "decode"

    def __init__(self, engine: LLMEngine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self.layout = KVCacheLayout.of_cache(engine.model.kv_cache, engine.config.block_size)
        self.remote: KVCacheLayout | None = None
        self.stats = DecodeStats()
        self.staging = StagingBuffer()  # the receive buffer, reused every round
        self._planned: dict[str, tuple[Offer, int, np.ndarray]] = {}  # id -> (offer, hit, rows)

    def run(self) -> DecodeStats:
        """Handshake, then take rounds until the prefill side is done, decoding one step per
        round; then decode what is left."""
        self.remote = handshake(self.transport, self.layout, "decode", "prefill")
        while True:
            rnd: Round = self.transport.recv_message()
            if rnd.done:
                break
            try:
                self._round(rnd)
            except PeerLostError:
                self._drop_planned()
                raise
            if self.engine.has_unfinished():
                self.engine.step()
        while self.engine.has_unfinished():
            self.engine.step()
        return self.stats

    def _round(self, rnd: Round) -> None:
        self.transport.send_message(self._plan_batch(rnd.offers))
        if not self._planned:
            return
        header: DataHeader = self.transport.recv_message()
        for req_id in header.failed:
            self._recompute(req_id)
        if header.sent:
            self._receive(header.sent, header.rows_per_piece)

    def _plan_batch(self, batch: OfferBatch) -> PlanBatch:
        """Admit and allocate each offer that fits now, in order (once one waits, the later
        ones wait too); then map every admitted offer's missing tokens to both sides' rows in
        one pass per side."""
        n = len(batch)
        statuses = np.full(n, PlanStatus.WAIT, dtype=np.int8)
        reasons: dict[int, str] = {}
        admitted: list[int] = []
        admitted_ids: set[str] = set()
        hits: list[int] = []
        waiting = False
        for i in range(n):
            offer = batch.offer(i)
            status, detail = self._admit(offer, waiting, admitted_ids)
            statuses[i] = status
            if status == PlanStatus.SEND:
                admitted.append(i)
                admitted_ids.add(offer.req_id)
                hits.append(int(detail))
            elif status == PlanStatus.REFUSED:
                reasons[i] = str(detail)
            waiting = waiting or status == PlanStatus.WAIT  # keep arrival order
        num_blocks = np.zeros(n, dtype=np.int64)
        if not admitted:
            return PlanBatch(statuses, np.zeros(0, np.int64), num_blocks, reasons)
        assert self.remote is not None
        chunk_tokens = chunk_tokens_of(self.layout.block_size, self.remote.block_size)
        idx = np.array(admitted)
        first = np.array(hits, dtype=np.int64)
        num = batch.prompt_starts[idx + 1] - batch.prompt_starts[idx] - first
        src, _ = chunk_rows_many(batch.block_ids, batch.block_starts[idx],
                                 batch.block_starts[idx + 1] - batch.block_starts[idx],
                                 self.remote.block_size, chunk_tokens, first, num)
        manager = self.engine.manager
        own = [manager.block_ids(batch.req_ids[i])[0] for i in admitted]
        own_counts = np.array([len(b) for b in own], dtype=np.int64)
        own_starts = np.zeros(len(own), dtype=np.int64)
        np.cumsum(own_counts[:-1], out=own_starts[1:])
        dst, dst_starts = chunk_rows_many(np.fromiter((b for ids in own for b in ids),
                                                      dtype=np.int64, count=int(own_counts.sum())),
                                          own_starts, own_counts, self.layout.block_size,
                                          chunk_tokens, first, num)
        for k, i in enumerate(admitted):
            num_blocks[i] = num_blocks_touched(self.layout.block_size, hits[k], int(num[k]))
            self._planned[batch.req_ids[i]] = (batch.offer(i), hits[k],
                                               dst[dst_starts[k]:dst_starts[k + 1]])
        return PlanBatch(statuses, src, num_blocks, reasons)

    def _admit(self, offer: Offer, waiting: bool, admitted_now: set[str]
               ) -> tuple[PlanStatus, int | str]:
        """SEND with the prefix-hit tokens (the request admitted, its prompt's blocks
        allocated), WAIT, or REFUSED with the reason; ``admitted_now``: this round's earlier
        SEND offers."""
        manager, config = self.engine.manager, self.engine.config
        tokens = np.append(offer.prompt_token_ids, np.int64(offer.first_token))
        num_prompt = len(offer.prompt_token_ids)
        num_kv_tokens = num_prompt + offer.max_new_tokens - 1
        never = (num_kv_tokens > config.max_model_len
                 or math.ceil(num_kv_tokens / config.block_size) > config.num_blocks - 1)
        if never:
            self.stats.refused.append(offer.req_id)
            return PlanStatus.REFUSED, (
                f"needs {num_kv_tokens} tokens; the decode side has max_model_len="
                f"{config.max_model_len} and {config.num_blocks - 1} blocks of "
                f"{config.block_size} tokens")
        if offer.req_id in self.engine.requests or offer.req_id in admitted_now:
            self.stats.refused.append(offer.req_id)
            return PlanStatus.REFUSED, "request id already here"
        num_hit = manager.lookup_prefix(tokens)
        if waiting or not manager.can_admit(tokens, num_prompt - num_hit):
            # running requests (and this round's, once they run) will free blocks
            if self.engine.has_unfinished() or admitted_now:
                self.stats.num_waits += 1
                return PlanStatus.WAIT, 0
            self.stats.refused.append(offer.req_id)
            return PlanStatus.REFUSED, "the decode side is idle and still lacks blocks or rows"
        num_hit = manager.add_request(offer.req_id, tokens)
        manager.allocate(offer.req_id, num_prompt - num_hit)
        return PlanStatus.SEND, num_hit

    def _receive(self, req_ids: tuple[str, ...], rows_per_piece: int) -> None:
        """Receive the buffer piece by piece into this side's staging memory, scattering each
        piece while the next arrives."""
        assert self.remote is not None
        chunk_tokens = chunk_tokens_of(self.layout.block_size, self.remote.block_size)
        kv_cache = self.engine.model.kv_cache
        dst = np.concatenate([self._planned[r][2] for r in req_ids])
        view = chunk_view(kv_cache, chunk_tokens)
        pieces = self.staging.pieces(view, dst.size, rows_per_piece)
        t0 = time.perf_counter()
        for i in self.transport.recv_tensors([piece for _, _, piece in pieces]):
            start, stop, piece = pieces[i]
            scatter_chunks(kv_cache, dst[start:stop], chunk_tokens, piece)
        elapsed = time.perf_counter() - t0
        bytes_per_row = view.shape[0] * view.shape[2] * view.element_size()
        self.transport.send_message(Ack(req_ids))
        for req_id in req_ids:
            offer, num_hit, rows = self._planned.pop(req_id)
            self._start_decoding(offer, num_hit)
            self.stats.transfers.append(TransferRecord(
                req_id, num_blocks_touched(self.layout.block_size, num_hit,
                                           len(offer.prompt_token_ids) - num_hit),
                int(rows.size) * bytes_per_row, elapsed, num_hit, len(req_ids)))

    def _start_decoding(self, offer: Offer, num_hit: int) -> None:
        """The prompt's KV is here: mark it computed, run the request from its first token."""
        engine = self.engine
        engine.manager.mark_computed(offer.req_id, len(offer.prompt_token_ids) - num_hit)
        req = Request(offer.req_id, offer.prompt_token_ids.tolist(), offer.max_new_tokens,
                      engine.step_index, status=RequestStatus.RUNNING,
                      output_token_ids=[offer.first_token], num_cached_tokens=num_hit)
        engine.requests[offer.req_id] = req
        engine.scheduler.running.append(req)

    def _recompute(self, req_id: str) -> None:
        """The KV never came: free the allocation, compute the request here from its prompt."""
        offer, _, _ = self._planned.pop(req_id)
        self.engine.manager.free(req_id)
        self.engine.add_request(req_id, offer.prompt_token_ids.tolist(), offer.max_new_tokens)
        self.stats.recomputed.append(req_id)

    def _drop_planned(self) -> None:
        for req_id in list(self._planned):
            self._planned.pop(req_id)
            self.engine.manager.free(req_id)
