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

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from blocktable.engine import LLMEngine, Request, RequestStatus
from blocktable.transfer.buffers import StagingBuffer, chunk_view, scatter_chunks
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout
from blocktable.transfer.messages import (
    OfferBatch,
    PlanBatch,
    PlanStatus,
    Round,
)
from blocktable.transfer.plan import chunk_rows_many, chunk_tokens_of
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


@dataclass(frozen=True, eq=False)
class _RoundPlan:
    """A round's admitted (SEND) offers, in offer order: flat arrays, no object per request."""

    batch: OfferBatch
    req_ids: list[str]
    index: np.ndarray  # on cpu, int64 [k]: their positions in the batch
    num_hit: np.ndarray  # on cpu, int64 [k]: prompt tokens this side's prefix cache held
    num_blocks: np.ndarray  # on cpu, int64 [k]: blocks allocated here for the rest
    dst_rows: np.ndarray  # on cpu, int64 [total chunks]: this side's chunk rows, in order
    dst_starts: np.ndarray  # on cpu, int64 [k + 1]: request j's rows are dst_rows[s[j]:s[j+1]]


@dataclass(frozen=True, eq=False)
class _ReceivedRound:
    """What a received round leaves in the statistics (not its prompts)."""

    req_ids: list[str]
    num_blocks: np.ndarray  # on cpu, int64 [k]
    num_hit: np.ndarray  # on cpu, int64 [k]
    num_bytes: np.ndarray  # on cpu, int64 [k]
    time_s: float


@dataclass
class DecodeStats:
    rounds: list[_ReceivedRound] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)  # failed transfers, computed here
    num_waits: int = 0

    @property
    def transfers(self) -> list[TransferRecord]:
        """One record per received request (built when asked, not per round)."""
        return [TransferRecord(req_id, int(r.num_blocks[j]), int(r.num_bytes[j]), r.time_s,
                               int(r.num_hit[j]), len(r.req_ids))
                for r in self.rounds for j, req_id in enumerate(r.req_ids)]


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
        self._plan: _RoundPlan | None = None  # admitted this round, KV not yet here
        self._num_received = 0  # requests whose KV came last round: the next plan says so

    def run(self) -> DecodeStats:
        """Handshake, then take rounds until the prefill side is done, decoding one step per
        round; then decode what is left."""
        self.remote = handshake(self.transport, self.layout, "decode", "prefill")
        while True:
            rnd: Round = self.transport.recv_message()
            try:
                self._round(rnd)
            except PeerLostError:
                self._drop_planned()
                raise
            if rnd.done:
                break
            if self.engine.has_unfinished():
                self.engine.step()
        while self.engine.has_unfinished():
            self.engine.step()
        return self.stats

    @property
    def chunk_tokens(self) -> int:
        """Tokens per moved chunk: contiguous in both sides' caches (kernel blocks)."""
        assert self.remote is not None
        return chunk_tokens_of(self.layout.kernel_block_size, self.remote.kernel_block_size)

    def _round(self, rnd: Round) -> None:
        """Answer the offers (acknowledging the last round's data), then take this round's."""
        plans = self._plan_batch(rnd.offers)
        self.transport.send_message(replace(plans, num_acked=self._num_received))
        self._num_received = 0
        plan = self._plan
        if plan is None:
            return
        status = torch.empty(2, dtype=torch.int64, device=self.engine.model.kv_cache.device)
        for _ in self.transport.recv_tensors((status,)):
            pass
        gathered, rows_per_piece = status.tolist()
        if gathered:
            self._receive(plan, rows_per_piece)
            self._num_received = len(plan.req_ids)
        else:
            self._recompute(plan)
        self._plan = None

    def _plan_batch(self, batch: OfferBatch) -> PlanBatch:
        """Admit and allocate each offer that fits now, in order (once one waits, the later
        ones wait too); then map every admitted offer's missing tokens to both sides' rows in
        one pass per side.

        The leading offers that fit even with no prefix hit are admitted by one batched
        allocator call; the rest one by one, as the engine's scheduler admits (a prefix hit
        may make one fit)."""
        n = len(batch)
        statuses = np.full(n, PlanStatus.WAIT, dtype=np.int8)
        reasons: dict[int, str] = {}
        self._plan = None
        if not n:
            return PlanBatch(statuses, np.zeros(0, np.int64), reasons)
        config, manager = self.engine.config, self.engine.manager
        num_prompt = batch.num_prompt_tokens
        num_kv = num_prompt + batch.max_new_tokens - 1
        # past max_model_len, or more blocks than the pool has (the null block aside)
        never = num_kv > min(config.max_model_len, (config.num_blocks - 1) * config.block_size)
        known = self.engine.requests
        if known.keys().isdisjoint(batch.req_ids) and len(set(batch.req_ids)) == n:
            here = np.zeros(n, dtype=bool)
        else:  # an id already here, or repeated: its later offers are refused
            here = np.fromiter((r in known for r in batch.req_ids), dtype=bool, count=n)
            seen: set[str] = set()
            for i, r in enumerate(batch.req_ids):
                here[i] |= r in seen
                seen.add(r)
        bad = never | here
        if not bad.any():
            candidates = np.arange(n)
        else:
            for i in np.flatnonzero(bad).tolist():
                statuses[i] = PlanStatus.REFUSED
                self.stats.refused.append(batch.req_ids[i])
                reasons[i] = ("request id already here" if here[i] else
                              f"needs {num_kv[i]} tokens; the decode side has max_model_len="
                              f"{config.max_model_len} and {config.num_blocks - 1} blocks of "
                              f"{config.block_size} tokens")
            candidates = np.flatnonzero(~bad)
        # each takes at most ceil(prompt / block_size) blocks from the pool, hit or not
        need = np.cumsum(-(-num_prompt[candidates] // config.block_size))
        k = min(int(np.searchsorted(need, manager.num_free_blocks(), side="right")),
                manager.num_free_rows)
        admitted = candidates[:k].tolist()
        sure_hits, sure_ids = self._admit_many(batch, candidates[:k], num_prompt)
        hits, new_ids = [sure_hits], [sure_ids]
        waiting = False
        for i in candidates[k:].tolist():
            status, hit, ids = self._admit_one(batch, i, waiting, bool(admitted))
            statuses[i] = status
            if status == PlanStatus.SEND:
                admitted.append(i)
                hits.append(np.array([hit], dtype=np.int64))
                new_ids.append(ids)
            elif status == PlanStatus.REFUSED:
                reasons[i] = "the decode side is idle and still lacks blocks or rows"
            waiting = waiting or status == PlanStatus.WAIT  # keep arrival order
        if not admitted:
            return PlanBatch(statuses, np.zeros(0, np.int64), reasons)
        idx = candidates[:k] if len(hits) == 1 else np.array(admitted, dtype=np.int64)
        statuses[idx] = PlanStatus.SEND
        num_hit = hits[0] if len(hits) == 1 else np.concatenate(hits)
        num = num_prompt[idx] - num_hit
        chunk_tokens = self.chunk_tokens
        assert self.remote is not None
        src_starts = batch.block_starts[idx]
        src, _ = chunk_rows_many(batch.block_ids, src_starts, batch.block_starts[idx + 1]
                                 - src_starts, self.remote.kernel_block_size, chunk_tokens,
                                 num_hit, num)
        # this side's new blocks hold exactly the tokens past the hit (a block boundary)
        num_blocks = -(-num_prompt[idx] // config.block_size) - num_hit // config.block_size
        own = np.concatenate(new_ids)
        if own.size != int(num_blocks.sum()):
            raise AssertionError(f"the allocator gave {own.size} blocks, "
                                 f"{int(num_blocks.sum())} were expected")
        own_starts = np.zeros(idx.size, dtype=np.int64)
        np.cumsum(num_blocks[:-1], out=own_starts[1:])
        dst, dst_starts = chunk_rows_many(own, own_starts, num_blocks, config.block_size,
                                          chunk_tokens, np.zeros_like(num), num)
        req_ids = list(batch.req_ids) if idx.size == n else [batch.req_ids[i] for i in admitted]
        self._plan = _RoundPlan(batch, req_ids, idx, num_hit, num_blocks, dst, dst_starts)
        return PlanBatch(statuses, src, reasons)

    def _admit_many(self, batch: OfferBatch, index: np.ndarray, num_prompt: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Admit ``batch``'s offers at ``index`` (they fit; ``num_prompt``: every offer's
        prompt tokens) and allocate their prompts: one batched call each. Returns their
        prefix-hit tokens (int64 ``[k]``) and the new block ids, request after request
        (int32)."""
        if not index.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        manager = self.engine.manager
        ids = [batch.req_ids[i] for i in index.tolist()]
        tokens, starts = batch.token_ids, batch.token_starts.tolist()
        prompts = [tokens[starts[i]:starts[i + 1]] for i in index.tolist()]
        hits = np.array(manager.add_requests(ids, prompts), dtype=np.int64)
        try:
            blocks = manager.allocate_many(ids, num_prompt[index] - hits)[0]
        except Exception:
            manager.free_many(ids)
            raise
        return hits, blocks.block_ids

    def _admit_one(self, batch: OfferBatch, i: int, waiting: bool, admitted_before: bool
                   ) -> tuple[PlanStatus, int, np.ndarray]:
        """SEND with the prefix-hit tokens and the new block ids (the request admitted, its
        prompt's blocks allocated), WAIT, or REFUSED (this side is idle and still lacks
        room); ``admitted_before``: this round admitted an earlier offer."""
        manager = self.engine.manager
        tokens = batch.token_ids[batch.token_starts[i]:batch.token_starts[i + 1]]
        num_prompt = tokens.size - 1
        num_hit = manager.lookup_prefix(tokens)
        if waiting or not manager.can_admit(tokens, num_prompt - num_hit):
            # running requests (and this round's, once they run) will free blocks
            if self.engine.has_unfinished() or admitted_before:
                self.stats.num_waits += 1
                return PlanStatus.WAIT, 0, np.zeros(0, np.int32)
            self.stats.refused.append(batch.req_ids[i])
            return PlanStatus.REFUSED, 0, np.zeros(0, np.int32)
        num_hit = manager.add_request(batch.req_ids[i], tokens)
        new = manager.allocate(batch.req_ids[i], num_prompt - num_hit)[0]
        return PlanStatus.SEND, num_hit, np.array(new, dtype=np.int32)

    def _receive(self, plan: _RoundPlan, rows_per_piece: int) -> None:
        """Receive the buffer piece by piece into this side's staging memory, scattering each
        piece while the next arrives; then start decoding (the next plan acknowledges)."""
        chunk_tokens = self.chunk_tokens
        kv_cache = self.engine.model.kv_cache
        view = chunk_view(kv_cache, chunk_tokens)
        pieces = self.staging.pieces(view, plan.dst_rows.size, rows_per_piece)
        t0 = time.perf_counter()
        for i in self.transport.recv_tensors([piece for _, _, piece in pieces]):
            start, stop, piece = pieces[i]
            scatter_chunks(kv_cache, plan.dst_rows[start:stop], chunk_tokens, piece)
        elapsed = time.perf_counter() - t0
        self._start_decoding(plan)
        bytes_per_row = view.shape[0] * view.shape[2] * view.element_size()
        self.stats.rounds.append(_ReceivedRound(plan.req_ids, plan.num_blocks, plan.num_hit,
                                                np.diff(plan.dst_starts) * bytes_per_row,
                                                elapsed))

    def _start_decoding(self, plan: _RoundPlan) -> None:
        """The prompts' KV is here: mark it computed (one allocator call); each request runs
        from its first token."""
        batch = plan.batch
        num_prompt = batch.num_prompt_tokens[plan.index]
        self.engine.manager.mark_computed_many(plan.req_ids, num_prompt - plan.num_hit)
        self._add_running(plan)

    def _add_running(self, plan: _RoundPlan) -> None:
        """The engine's ``Request`` of each, running from its first token."""
        engine, batch = self.engine, plan.batch
        max_new = batch.max_new_tokens[plan.index].tolist()
        first = batch.first_tokens[plan.index].tolist()
        hit = plan.num_hit.tolist()
        tokens = batch.token_ids
        starts = batch.token_starts.tolist()
        step, running, requests = engine.step_index, engine.scheduler.running, engine.requests
        for j, (req_id, i) in enumerate(zip(plan.req_ids, plan.index.tolist())):
            req = Request(req_id, tokens[starts[i]:starts[i + 1] - 1].tolist(), max_new[j], step,
                          status=RequestStatus.RUNNING, output_token_ids=[first[j]],
                          num_cached_tokens=hit[j])
            requests[req_id] = req
            running.append(req)

    def _recompute(self, plan: _RoundPlan) -> None:
        """The KV never came: free the allocations, compute the requests here from their
        prompts."""
        self.engine.manager.free_many(plan.req_ids)
        for req_id, i in zip(plan.req_ids, plan.index.tolist()):
            self.engine.add_request(req_id, plan.batch.prompt(i).tolist(),
                                    int(plan.batch.max_new_tokens[i]))
            self.stats.recomputed.append(req_id)

    def _drop_planned(self) -> None:
        if self._plan is not None:
            self.engine.manager.free_many(self._plan.req_ids)
            self._plan = None
