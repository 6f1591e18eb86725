"""The decode side: take offered requests into the allocator, receive their KV, decode.

For each offer the decode side asks its allocator: a prefix hit shares cached blocks (those
tokens are not sent), then blocks for the rest of the prompt are allocated. The plan sent back
says, per offer, from which prompt token on this side lacks the KV (the prefill side maps those
tokens to its own rows, in token order); the buffer that comes back is scattered into this
side's rows (its own block ids and block size), the tokens are marked computed and the request
joins the running batch with its first token.

Out of blocks: the offer waits while running requests will free some, else it is refused.
A batch the prefill side could not gather is recomputed here from its prompt. A lost prefill
side frees every allocation of the round and raises :class:`PeerLostError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch

from blocktable.engine import LLMEngine, Request, RequestStatus
from blocktable.transfer.buffers import StagingBuffer
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout
from blocktable.transfer.messages import OfferBatch, PlanBatch, PlanStatus
from blocktable.transfer.plan import chunk_rows_many, chunk_tokens_of
from blocktable.transfer.transfer_errors import PeerLostError
from blocktable.transfer.transport import Transport

_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False


def _token_ids(batch: OfferBatch, i: int) -> np.ndarray:
    """Offer ``i``'s token ids (a view): its prompt, then its first token."""
    return batch.token_ids[batch.token_starts[i]:batch.token_starts[i + 1]]


@dataclass(frozen=True)
class TransferRecord:
    """One request's transfer as the decode side saw it."""

    req_id: str
    num_blocks: int  # decode-side blocks written
    num_bytes: int
    time_s: float  # its round's receive and scatter (shared by the round's requests)
    num_hit_tokens: int  # prompt tokens this side's prefix cache already held
    batch_size: int  # requests moved in the same buffer


@dataclass(eq=False, slots=True)
class _RoundPlan:
    """A round's admitted (SEND) offers, in offer order: flat arrays, no object per request
    (but the views of each one's token ids that the allocator was given)."""

    req_ids: list[str]
    token_ids: list[np.ndarray]  # on cpu, int64 views into the offer: prompt, first token
    max_new_tokens: np.ndarray  # on cpu, int64 [k]
    stop_token_ids: list[frozenset[int]]  # each one's stop tokens
    num_hit: np.ndarray  # on cpu, int64 [k]: prompt tokens this side's prefix cache held
    num_new: np.ndarray  # on cpu, int64 [k]: prompt tokens past the hit, the ones that move
    num_blocks: np.ndarray  # on cpu, int64 [k]: blocks allocated here for them
    dst_rows: np.ndarray  # on cpu, int64 [total chunks]: this side's chunk rows, in order
    num_rows: np.ndarray  # on cpu, int64 [k]: each one's rows, back to back in dst_rows


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
        config = engine.config
        # the most tokens of KV a request may need here: max_model_len, or the pool (the null
        # block aside)
        self._kv_limit = min(config.max_model_len, (config.num_blocks - 1) * config.block_size)
        # the data's leading two int64 (messages.data_status), received into one tensor
        self._status = torch.empty(2, dtype=torch.int64, device=engine.model.kv_cache.device)

    def run(self) -> DecodeStats:
        """Handshake, then take rounds until the prefill side is done, decoding one step per
        round; then decode what is left."""
        self.remote = handshake(self.transport, self.layout, "decode", "prefill")
        while True:
            offers: OfferBatch = self.transport.recv_message()
            try:
                self._round(offers)
            except PeerLostError:
                self._drop_planned()
                raise
            if offers.done:
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

    def _round(self, offers: OfferBatch) -> None:
        """Answer the offers (acknowledging the last round's data), then take this round's."""
        plans = self._plan_batch(offers, self._num_received)
        self.transport.send_message(plans)
        self._num_received = 0
        plan = self._plan
        if plan is None:
            return
        for _ in self.transport.recv_tensors((self._status,)):
            pass
        gathered, rows_per_piece = self._status.tolist()
        if gathered:
            self._receive(plan, rows_per_piece)
            self._num_received = len(plan.req_ids)
        else:
            self._recompute(plan)
        self._plan = None

    def _plan_batch(self, batch: OfferBatch, num_acked: int = 0) -> PlanBatch:
        """Admit and allocate each offer that fits now, in order (once one waits, the later
        ones wait too); then map every admitted offer's missing tokens to this side's rows in
        one pass. ``num_acked``: the previous round's requests whose data arrived.

        The leading offers that fit even with no prefix hit are admitted by one batched
        allocator call (in the common round, all of them); the rest one by one, as the
        engine's scheduler admits (a prefix hit may make one fit)."""
        n = len(batch.req_ids)
        self._plan = None
        if not n:
            return PlanBatch(_NO_ROWS, _NO_ROWS, {}, num_acked)
        config, manager = self.engine.config, self.engine.manager
        block_size = config.block_size
        starts = batch.token_starts
        num_prompt = starts[1:] - starts[:-1]  # each prompt and its first token, then
        num_prompt -= 1  # each prompt alone
        # each takes at most ceil(prompt / block_size) blocks from the pool, hit or not
        prompt_blocks = num_prompt + (block_size - 1)
        prompt_blocks //= block_size
        reasons = self._refusals(batch, num_prompt)
        total_blocks = int(prompt_blocks.sum())
        if (not reasons and n <= manager.num_free_rows
                and total_blocks <= manager.num_free_blocks()):
            # the common round: every offer fits; SEND is 0, so one zero array serves as the
            # statuses and, without a prefix hit, as the hits
            req_ids, token_ids, num_hit, own = self._admit_many(batch, None, num_prompt)
            statuses = np.zeros(n, dtype=np.int64)
            hit = num_hit.size > 0
            if not hit:
                num_hit = statuses
            self._plan = self._map_rows(batch, None, req_ids, token_ids, num_hit, hit, own,
                                        num_prompt, prompt_blocks, total_blocks)
            return PlanBatch(statuses, num_hit, reasons, num_acked)
        statuses = np.full(n, int(PlanStatus.WAIT), dtype=np.int64)
        index, req_ids, token_ids, num_hit, own = self._admit_some(
            batch, statuses, reasons, num_prompt, prompt_blocks)
        if index is None:
            return PlanBatch(statuses, np.zeros(n, dtype=np.int64), reasons, num_acked)
        self._plan = self._map_rows(batch, index, req_ids, token_ids, num_hit, True, own,
                                    num_prompt, prompt_blocks, None)
        hits = np.zeros(n, dtype=np.int64)
        hits[index] = num_hit
        return PlanBatch(statuses, hits, reasons, num_acked)

    def _refusals(self, batch: OfferBatch, num_prompt: np.ndarray) -> dict[int, str]:
        """Offers that can never be taken (past ``max_model_len`` or the pool, or a request
        id already here or repeated), by index, with the reason; ``{}`` in the common round
        (two numpy calls and a set). ``num_prompt``: each offer's prompt tokens."""
        config = self.engine.config
        # past max_model_len, or more blocks than the pool has (the null block aside)
        limit = self._kv_limit
        # prompt + max_new_tokens - 1 tokens of KV (the last token's is never made)
        num_kv = num_prompt + batch.max_new_tokens
        known, req_ids = self.engine.requests, batch.req_ids
        distinct = set(req_ids)
        # (a keys view against a set looks up the smaller: not every request this side has
        # ever held, as a set against a dict would)
        if (len(distinct) == len(req_ids) and known.keys().isdisjoint(distinct)
                and int(num_kv.max()) <= limit + 1):
            return {}
        num_kv -= 1
        reasons: dict[int, str] = {}
        seen: set[str] = set()
        for i, (req_id, kv) in enumerate(zip(req_ids, num_kv.tolist())):
            if req_id in known or req_id in seen:  # its later offers are refused
                reasons[i] = "request id already here"
            elif kv > limit:
                reasons[i] = (f"needs {kv} tokens; the decode side has max_model_len="
                              f"{config.max_model_len} and {config.num_blocks - 1} blocks of "
                              f"{config.block_size} tokens")
            seen.add(req_id)
        self.stats.refused += [req_ids[i] for i in reasons]
        return reasons

    def _admit_some(self, batch: OfferBatch, statuses: np.ndarray, reasons: dict[int, str],
                    num_prompt: np.ndarray, prompt_blocks: np.ndarray
                    ) -> tuple[np.ndarray | None, list[str], list[np.ndarray], np.ndarray,
                               np.ndarray]:
        """A round where not every offer fits, or some are refused: the leading ones that fit
        even with no hit in one batched call, then one by one. Sets ``statuses`` and
        ``reasons``; returns the admitted offers' indices (``None``: none), ids, token ids, hits
        and new block ids, as :meth:`_admit_many`."""
        manager = self.engine.manager
        for i in reasons:
            statuses[i] = PlanStatus.REFUSED
        candidates = np.flatnonzero(statuses != PlanStatus.REFUSED)
        need = np.cumsum(prompt_blocks[candidates])
        k = min(int(np.searchsorted(need, manager.num_free_blocks(), side="right")),
                manager.num_free_rows)
        req_ids, token_ids, sure_hits, sure_ids = self._admit_many(batch, candidates[:k],
                                                                     num_prompt)
        admitted = candidates[:k].tolist()
        hits = [sure_hits if sure_hits.size else np.zeros(k, dtype=np.int64)]
        new_ids = [sure_ids]
        waiting = False
        for i in candidates[k:].tolist():
            status, hit, ids = self._admit_one(batch, i, waiting, bool(admitted))
            statuses[i] = status
            if status == PlanStatus.SEND:
                admitted.append(i)
                req_ids.append(batch.req_ids[i])
                token_ids.append(_token_ids(batch, i))
                hits.append(np.array([hit], dtype=np.int64))
                new_ids.append(ids)
            elif status == PlanStatus.REFUSED:
                reasons[i] = "the decode side is idle and still lacks blocks or rows"
            waiting = waiting or status == PlanStatus.WAIT  # keep arrival order
        if not admitted:
            return None, [], [], _NO_ROWS, _NO_ROWS
        index = np.array(admitted, dtype=np.int64)
        statuses[index] = PlanStatus.SEND
        return index, req_ids, token_ids, np.concatenate(hits), np.concatenate(new_ids)

    def _map_rows(self, batch: OfferBatch, index: np.ndarray | None, req_ids: list[str],
                  token_ids: list[np.ndarray], num_hit: np.ndarray, hit: bool,
                  own: np.ndarray, num_prompt: np.ndarray, prompt_blocks: np.ndarray,
                  total_blocks: int | None) -> _RoundPlan:
        """The round's plan: this side's chunk rows of the admitted offers (``index`` into the
        batch, ``None``: all), their missing tokens only, in one pass. ``hit``: some
        ``num_hit`` is not 0; ``total_blocks``: the sum of ``prompt_blocks`` (all offers
        admitted), ``None`` when not known."""
        block_size = self.engine.config.block_size
        max_new = batch.max_new_tokens
        if index is not None:
            num_prompt, prompt_blocks = num_prompt[index], prompt_blocks[index]
            max_new = max_new[index]
        if hit:
            num_new = num_prompt - num_hit
            # this side's new blocks hold exactly the tokens past the hit (a block boundary)
            num_blocks = prompt_blocks - num_hit // block_size
            total_blocks = None
        else:
            num_new, num_blocks = num_prompt, prompt_blocks
        if total_blocks is None:
            total_blocks = int(np.add.reduce(num_blocks))
        if own.size != total_blocks:
            raise AssertionError(f"the allocator gave {own.size} blocks, {total_blocks} were "
                                 "expected")
        chunk_tokens = self.chunk_tokens
        if chunk_tokens == block_size:
            # chunks of whole blocks: this side's rows are the new blocks as allocated (each
            # request got exactly those of its tokens past the hit, checked above), the one
            # case of chunk_rows_many that needs no mapping
            dst, num_rows = own.astype(np.int64), num_blocks
        else:
            dst, num_rows = chunk_rows_many(own, None, num_blocks, block_size, chunk_tokens,
                                            None, num_new)
        return _RoundPlan(req_ids, token_ids, max_new, batch.stops(index), num_hit, num_new,
                          num_blocks, dst, num_rows)

    def _admit_many(self, batch: OfferBatch, index: np.ndarray | None, num_prompt: np.ndarray
                    ) -> tuple[list[str], list[np.ndarray], np.ndarray, np.ndarray]:
        """Admit ``batch``'s offers at ``index`` (``None``: all; they fit) and allocate their
        prompts (``num_prompt``: every offer's prompt tokens): one batched call each. Returns
        their ids, token ids (views: prompt, then first token; the first one's id known from
        the start, as after a prefill here), prefix-hit tokens (int64 ``[k]``; empty when none
        hit) and the new block ids, request after request (int32)."""
        tokens, starts = batch.token_ids, batch.token_starts.tolist()
        if index is None:
            req_ids = list(batch.req_ids)
            token_ids = [tokens[a:b] for a, b in pairwise(starts)]
        else:
            if not index.size:
                return [], [], _NO_ROWS, np.zeros(0, np.int32)
            at = index.tolist()
            req_ids = [batch.req_ids[i] for i in at]
            token_ids = [tokens[starts[i]:starts[i + 1]] for i in at]
            num_prompt = num_prompt[index]
        manager = self.engine.manager
        hits = manager.add_requests(req_ids, token_ids)
        num_hit = np.array(hits, dtype=np.int64) if any(hits) else _NO_ROWS
        try:
            blocks = manager.allocate_many(req_ids, num_prompt - num_hit if num_hit.size
                                           else num_prompt)[0]
        except Exception:
            manager.free_many(req_ids)
            raise
        return req_ids, token_ids, num_hit, blocks.block_ids

    def _admit_one(self, batch: OfferBatch, i: int, waiting: bool, admitted_before: bool
                   ) -> tuple[PlanStatus, int, np.ndarray]:
        """SEND with the prefix-hit tokens and the new block ids (the request admitted, its
        prompt's blocks allocated), WAIT, or REFUSED (this side is idle and still lacks
        room); ``admitted_before``: this round admitted an earlier offer."""
        manager = self.engine.manager
        tokens = _token_ids(batch, i)
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
        t0 = time.perf_counter()
        self.staging.scatter(kv_cache, plan.dst_rows, chunk_tokens, rows_per_piece,
                             self.transport.recv_tensors)
        elapsed = time.perf_counter() - t0
        self._start_decoding(plan)
        num_layers, two, _, _, num_kv_heads, head_dim = kv_cache.shape
        bytes_per_row = (num_layers * two * chunk_tokens * num_kv_heads * head_dim
                         * kv_cache.element_size())
        self.stats.rounds.append(_ReceivedRound(plan.req_ids, plan.num_blocks, plan.num_hit,
                                                plan.num_rows * bytes_per_row,
                                                elapsed))

    def _start_decoding(self, plan: _RoundPlan) -> None:
        """The prompts' KV is here: mark it computed (one allocator call); each request runs
        from its first token."""
        self.engine.manager.mark_computed_many(plan.req_ids, plan.num_new)
        self._add_running(plan)

    def _add_running(self, plan: _RoundPlan) -> None:
        """The engine's ``Request`` of each, running from its first token."""
        engine = self.engine
        step, running, requests = engine.step_index, engine.scheduler.running, engine.requests
        for req_id, tokens, max_new, stops, hit in zip(
                plan.req_ids, plan.token_ids, plan.max_new_tokens.tolist(), plan.stop_token_ids,
                plan.num_hit.tolist()):
            prompt = tokens.tolist()
            first = prompt.pop()
            req = Request(req_id, prompt, max_new, step, status=RequestStatus.RUNNING,
                          output_token_ids=[first], num_cached_tokens=hit,
                          stop_token_ids=stops)
            requests[req_id] = req
            running.append(req)

    def _recompute(self, plan: _RoundPlan) -> None:
        """The KV never came: free the allocations, compute the requests here from their
        prompts."""
        self.engine.manager.free_many(plan.req_ids)
        for req_id, tokens, max_new, stops in zip(plan.req_ids, plan.token_ids,
                                                  plan.max_new_tokens.tolist(),
                                                  plan.stop_token_ids):
            self.engine.add_request(req_id, tokens[:-1].tolist(), max_new,
                                    stop_token_ids=stops)
            self.stats.recomputed.append(req_id)

    def _drop_planned(self) -> None:
        if self._plan is not None:
            self.engine.manager.free_many(self._plan.req_ids)
            self._plan = None
