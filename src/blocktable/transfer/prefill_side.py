"""The prefill side: compute prompts, offer them, send the blocks the decode side asks for.

Each round: one engine step; requests whose prompt is done (first token sampled) leave the
scheduler but keep their blocks; they are offered to the decode side, which answers, per
offer, from which prompt token on it lacks the KV. Those tokens are mapped to this side's
chunk rows (its table's rows, one pass for the round), whose every layer is gathered into
one staging buffer, piece by piece, each piece sent while the next is gathered (on a GPU; on
the CPU the buffer is one piece by default: :func:`~blocktable.transfer.buffers.
default_piece_bytes`). A request's blocks are freed (its full blocks stay in the prefix
cache) only once the decode side's next plan acknowledges the data, or it refuses the
request, or it is lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import attrgetter

import numpy as np
import torch

from blocktable.engine import LLMEngine, Request, RequestStatus
from blocktable.transfer.buffers import StagingBuffer, chunk_view, default_piece_bytes
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout
from blocktable.transfer.messages import OfferBatch, PlanBatch, PlanStatus, data_status
from blocktable.transfer.plan import (
    chunk_rows_many,
    chunk_tokens_of,
    leading_blocks,
    leading_masks,
)
from blocktable.transfer.prompt_arena import PromptArena
from blocktable.transfer.transfer_errors import PeerLostError
from blocktable.transfer.transport import Transport
from blocktable.transfer.wire_format import TEXT_SEPARATOR

_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False
_REQ_ID = attrgetter("req_id")


@dataclass
class PrefillStats:
    """What the prefill side did, by request id."""

    sent: list[str] = field(default_factory=list)
    # requests whose first token was one of their stop tokens: done here, nothing moved
    finished: dict[str, list[int]] = field(default_factory=dict)  # request -> its one token
    refused: dict[str, str] = field(default_factory=dict)  # request -> the decode side's reason
    failed: list[str] = field(default_factory=list)  # gathers that failed (recomputed there)
    num_waits: int = 0  # offers the decode side asked to repeat later
    send_time_s: float = 0.0  # gathers and sends, overlapped


class _Handed:
    """Requests of the prefill side, one list per field (no object of its own per request):
    the pending ones (prompt done, blocks held, not yet sent) or those sent and waiting for the
    acknowledgement. A round's offer is then a few array conversions of whole lists."""

    __slots__ = ("first_tokens", "req_ids", "reqs")

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.req_ids: list[str] = []
        self.first_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.req_ids)

    def extend(self, other: _Handed) -> None:
        for name in self.__slots__:
            getattr(self, name).extend(getattr(other, name))

    def split(self, keep: Sequence[bool]) -> tuple[_Handed, _Handed]:
        """``(kept, rest)``: the requests where ``keep`` is true, and the others, in order."""
        kept, rest = _Handed(), _Handed()
        drop = [not k for k in keep]
        for name in self.__slots__:
            values = getattr(self, name)
            setattr(kept, name, list(compress(values, keep)))
            setattr(rest, name, list(compress(values, drop)))
        return kept, rest


class PrefillWorker:
    """Wraps an :class:`LLMEngine` that only prefills; talks to one decode side.

    Parameters
    ----------
    engine : LLMEngine
        The prefill engine (its allocator, table and KV cache).
    transport : Transport
        The wire to the decode side.
    piece_bytes : int, optional
        The send buffer goes out in pieces of about this size, each gathered while the one
        before travels (:class:`~blocktable.transfer.buffers.StagingBuffer`); default
        :func:`~blocktable.transfer.buffers.default_piece_bytes` of the cache's device.
    """

    role = "prefill"

    def __init__(self, engine: LLMEngine, transport: Transport,
                 piece_bytes: int | None = None) -> None:
        self.engine = engine
        self.transport = transport
        if piece_bytes is None:
            piece_bytes = default_piece_bytes(engine.model.kv_cache.device)
        self.staging = StagingBuffer(piece_bytes)  # the send buffer, reused every round
        self.layout = KVCacheLayout.of_cache(engine.model.kv_cache, engine.config.block_size)
        self.remote: KVCacheLayout | None = None
        # per request until it is handed over: its prompt (with room for the first token),
        # its max_new_tokens and its stop tokens
        self.prompts = PromptArena()
        self.pending = _Handed()  # prompt done, blocks held, not yet sent
        self._unacked = _Handed()  # handed over this round, blocks held until the next ack
        self.stats = PrefillStats()
        # the last offer's token offsets (its prompts' lengths, for the plan's mapping)
        self._offered_starts = np.zeros(1, dtype=np.int64)
        # on the CPU, the data's leading tensor (and its numpy view), reused every round
        self._status_cpu: tuple[torch.Tensor, np.ndarray] | None = None
        if engine.model.kv_cache.device.type == "cpu":
            status = torch.zeros(2, dtype=torch.int64)
            self._status_cpu = status, status.numpy()

    def submit(self, req_id: str, prompt_token_ids: Sequence[int], max_new_tokens: int,
               stop_token_ids: Iterable[int] = ()) -> None:
        """Queue a request; its decode runs on the decode side, with the same stopping rules
        (at most ``max_new_tokens`` tokens, or up to the first of ``stop_token_ids``). A
        request whose first token is a stop token finishes here and moves nothing
        (:attr:`PrefillStats.finished`).

        Raises
        ------
        ValueError
            ``max_new_tokens < 2`` (one token needs no decode side), a ``req_id`` holding a
            NUL character (it cannot travel), or what :meth:`LLMEngine.add_request` refuses.
        """
        if isinstance(req_id, str) and TEXT_SEPARATOR in req_id:
            raise ValueError(f"req_id must not hold a NUL character (it cannot travel), got "
                             f"{req_id!r}")
        if max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 for a disaggregated request (the "
                             f"prefill side samples the first), got {max_new_tokens}")
        # Two tokens keep the request running after its first: it leaves the scheduler by hand.
        self.engine.add_request(req_id, prompt_token_ids, max_new_tokens=2,
                                stop_token_ids=stop_token_ids)
        self.prompts.add(req_id, prompt_token_ids, max_new_tokens,
                         self.engine.requests[req_id].stop_token_ids)

    def run(self) -> PrefillStats:
        """Handshake, then prefill and transfer until every submitted request is handed over
        (or refused); finally tell the decode side that nothing more comes."""
        self.remote = handshake(self.transport, self.layout, "prefill", "decode")
        try:
            while True:
                if self.engine.has_unfinished():
                    self._finished_here(self.engine.step().finished)
                self._collect_prefilled()
                done = not self.engine.has_unfinished() and not self.pending
                self.transport.send_message(self._offer_batch(done))
                plans: PlanBatch = self.transport.recv_message()
                self._acknowledged(plans.num_acked)
                if done:
                    return self.stats
                self._transfer_round(plans)
        except PeerLostError:  # the decode side is gone: nothing leaks here
            self.prompts.drop(self.pending.req_ids)
            self._release(self.pending)
            self._release(self._unacked)
            self.pending, self._unacked = _Handed(), _Handed()
            raise

    def _finished_here(self, req_ids: Sequence[str]) -> None:
        """Requests the step finished: their first token was a stop token (the engine freed
        their blocks; no decode side needs them)."""
        if not req_ids:
            return
        requests = self.engine.requests
        for req_id in req_ids:
            self.stats.finished[req_id] = list(requests[req_id].output_token_ids)
        self.prompts.drop(list(req_ids))

    def _collect_prefilled(self) -> None:
        """Take requests whose prompt is done out of the scheduler (blocks kept) into the
        pending ones."""
        running = self.engine.scheduler.running
        done = [req for req in running if req.output_token_ids]
        if not done:
            return
        if len(done) == len(running):
            running.clear()
        else:
            running[:] = [req for req in running if not req.output_token_ids]
        p = self.pending
        p.reqs += done
        p.req_ids += map(_REQ_ID, done)
        p.first_tokens += [req.output_token_ids[0] for req in done]

    def _offer_batch(self, done: bool = False) -> OfferBatch:
        """Every pending request as one message: its token ids and its other fields' arrays
        (slices of the prompts' arena, in the usual round); ``done``: nothing more comes."""
        p = self.pending
        if not p:
            return OfferBatch.empty(done)
        arrays = self.prompts.offer_arrays(p.req_ids, p.first_tokens)
        self._offered_starts = arrays[1]
        return OfferBatch(tuple(p.req_ids), *arrays, done)

    def _transfer_round(self, plans: PlanBatch) -> None:
        rows = self._read_plans(plans)
        if not self._unacked:  # nothing handed over (a request wholly hit there has no rows)
            return
        try:
            pieces = self._gather(rows, self.chunk_tokens)
            view = chunk_view(self.engine.model.kv_cache, self.chunk_tokens)
            gathered, status = True, self._data_status(True, self.staging.rows_per_piece(view))
        except Exception:  # noqa: BLE001 - the decode side recomputes; we free the blocks
            pieces, gathered, status = iter(()), False, self._data_status(False, 0)
        t0 = time.perf_counter()
        self.transport.send_tensors(chain((status,), pieces))
        self.stats.send_time_s += time.perf_counter() - t0
        if not gathered:  # the decode side recomputes them: nothing to acknowledge
            self.stats.failed += self._unacked.req_ids
            self._release(self._unacked)
            self._unacked = _Handed()

    @property
    def chunk_tokens(self) -> int:
        """Tokens per moved chunk: contiguous in both sides' caches (kernel blocks)."""
        assert self.remote is not None
        return chunk_tokens_of(self.layout.kernel_block_size, self.remote.kernel_block_size)

    def _acknowledged(self, num_acked: int) -> None:
        """The decode side holds the last round's KV: free those requests' blocks here."""
        if num_acked != len(self._unacked):
            raise RuntimeError(f"protocol error: the {self.transport.peer} acknowledged "
                               f"{num_acked} requests, {len(self._unacked)} were sent")
        if not num_acked:
            return
        self.stats.sent += self._unacked.req_ids
        self._release(self._unacked)
        self._unacked = _Handed()

    def _read_plans(self, plans: PlanBatch) -> np.ndarray:
        """Hand the offers to send over (their blocks held until the acknowledgement), free
        the refused ones (recorded), keep the waiting ones pending. Returns the chunk rows to
        send here, request after request, each from its first token the decode side lacks
        (int64 ``[total chunks]``); a plan that does not fit the offers raises before anything
        changes."""
        statuses = plans.statuses
        if statuses.size != len(self.pending):
            raise RuntimeError(f"protocol error: the {self.transport.peer} answered "
                               f"{statuses.size} offers, {len(self.pending)} were made")
        if not statuses.size:
            return _NO_ROWS
        if not np.count_nonzero(statuses):  # the common round: every offer is sent (SEND: 0)
            rows = self._src_rows(None, plans.num_hit)
            self._unacked, self.pending = self.pending, _Handed()
            self.prompts.drop(self._unacked.req_ids)  # (in the message already)
            return rows
        codes = statuses.tolist()
        send = [c == PlanStatus.SEND for c in codes]
        rows = self._src_rows(np.flatnonzero(send), plans.num_hit) if any(send) else _NO_ROWS
        self.stats.num_waits += codes.count(PlanStatus.WAIT)
        self._unacked, rest = self.pending.split(send)
        refused, self.pending = rest.split([c == PlanStatus.REFUSED for c in codes
                                            if c != PlanStatus.SEND])
        refused_at = [i for i, c in enumerate(codes) if c == PlanStatus.REFUSED]
        for req_id, i in zip(refused.req_ids, refused_at):
            self.stats.refused[req_id] = plans.reasons.get(i, "")
        self.prompts.drop(refused.req_ids + self._unacked.req_ids)
        self._release(refused)
        return rows

    def _src_rows(self, index: np.ndarray | None, num_hit: np.ndarray) -> np.ndarray:
        """This side's chunk rows of the offers at ``index`` (``None``: all), from each one's
        ``num_hit[i]``-th prompt token to its prompt's end: its table row's block ids through
        the slot formula, one numpy pass for the round.

        Raises
        ------
        RuntimeError
            A hit past the prompt, negative, or not at a chunk boundary (a malformed plan).
        """
        table = self.engine.table.tables[0]
        assert table is not None
        rows = self.engine.manager.rows_of(self.pending.req_ids)
        starts = self._offered_starts
        num_tokens = starts[1:] - starts[:-1]  # each prompt and its first token
        if index is not None:
            rows, num_tokens, num_hit = rows[index], num_tokens[index], num_hit[index]
        kernel_block_size, chunk_tokens = self.layout.kernel_block_size, self.chunk_tokens
        if chunk_tokens == kernel_block_size and not np.count_nonzero(num_hit):
            # the common round: every prompt whole, in whole kernel blocks, which its row of
            # the table holds since its prefill (its length checked at submit): no check again
            num_blocks = num_tokens + (kernel_block_size - 2)
            num_blocks //= kernel_block_size
            block_table = table.block_table_np
            return leading_blocks(block_table, rows, num_blocks,
                                  leading_masks(block_table.shape[1]))
        num_prompt = num_tokens - 1
        try:
            src, _ = chunk_rows_many(table.block_table_np, rows, table.num_kernel_blocks[rows],
                                     kernel_block_size, chunk_tokens, num_hit,
                                     num_prompt - num_hit)
        except ValueError as exc:
            raise RuntimeError(f"protocol error: the {self.transport.peer}'s plan does not fit "
                               f"the offers: {exc}") from exc
        return src

    def _data_status(self, gathered: bool, rows_per_piece: int) -> torch.Tensor:
        """:func:`~blocktable.transfer.messages.data_status` on the cache's device; on the CPU
        one tensor reused every round (the transport returns once it is sent)."""
        if self._status_cpu is None:
            return torch.from_numpy(data_status(gathered, rows_per_piece)).to(
                self.engine.model.kv_cache.device)
        status, host = self._status_cpu
        host[0], host[1] = int(gathered), rows_per_piece
        return status

    def _gather(self, rows: np.ndarray, chunk_tokens: int) -> Iterator[torch.Tensor]:
        """Every layer's K and V of ``rows``, piece after piece of the send buffer (checked
        at the call; each piece gathered in one launch when the transport asks for it)."""
        return self.staging.gather(self.engine.model.kv_cache, rows, chunk_tokens)

    def _release(self, handed: _Handed) -> None:
        """Free their blocks (full ones stay in the prefix cache) in one allocator call (their
        prompts are dropped when they leave the pending ones)."""
        if not handed.req_ids:
            return
        self.engine.manager.free_many(handed.req_ids)
        finished = RequestStatus.FINISHED
        for req in handed.reqs:
            req.status = finished
