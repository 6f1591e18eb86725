"""A context-parallel (DCP) decode side: each of its ranks receives only the chunks it owns.

The smallest complete form: one prefill process and the ``world_size`` ranks of a DCP decode
group, every pair joined by a :class:`~blocktable.transfer.transport.Transport`.

1. Each decode rank checks the prefill side's cache layout (the usual handshake).
2. The prefill side computes its prompts and offers them (an
   :class:`~blocktable.transfer.messages.OfferBatch`) to the DCP driver (DCP rank 0).
3. The driver's allocator (blocks of ``block_size * world_size`` tokens: the DCP layout's
   allocator spec) admits and allocates them, and sends a :class:`DcpPlan` (block ids, hits,
   the group's layout) to the prefill side and to every other decode rank.
4. Everyone maps the moved chunks through the table's CP slot formula
   (:func:`~blocktable.transfer.plan.dcp_chunk_rows_many`): the prefill side sends rank ``r``
   the rows of exactly the chunks ``r`` owns, in token order, one buffer; rank ``r`` scatters
   it into its own slots of those blocks. Nothing in the transport knows about DCP.
5. Each decode rank acknowledges; the prefill side frees its blocks after every rank has.

Decoding on the DCP side then runs as :class:`blocktable.engine.distributed.DistributedEngine`
does (not wired here: see ``docs/disaggregation.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from blocktable.allocator import KVCacheManager
from blocktable.engine import LLMEngine
from blocktable.transfer.buffers import StagingBuffer, chunk_view
from blocktable.transfer.kv_handshake import handshake
from blocktable.transfer.kv_layout import KVCacheLayout
from blocktable.transfer.messages import OfferBatch, data_status
from blocktable.transfer.plan import chunk_rows_many, chunk_tokens_of, dcp_chunk_rows_many
from blocktable.transfer.transfer_errors import PeerLostError
from blocktable.transfer.transport import Transport


@dataclass(frozen=True, eq=False)
class DcpPlan:
    """The DCP driver's answer: where the offered requests go, and the group's layout."""

    block_ids: np.ndarray  # on cpu, int64 [total blocks]: allocator blocks, the same on every rank
    block_starts: np.ndarray  # on cpu, int64 [num_reqs + 1]
    num_hit: np.ndarray  # on cpu, int64 [num_reqs]: prompt tokens the prefix cache held
    num_prompt: np.ndarray  # on cpu, int64 [num_reqs]
    world_size: int
    interleave: int
    block_size: int  # tokens per block on one rank
    chunk_tokens: int

    def chunks(self) -> tuple[np.ndarray, np.ndarray]:
        """Owner rank and row there of every moved chunk (int64 ``[total chunks]`` each),
        request after request, in token order."""
        owners, rows, _ = dcp_chunk_rows_many(
            self.block_ids, self.block_starts[:-1], np.diff(self.block_starts),
            self.block_size, self.world_size, self.interleave, self.chunk_tokens, self.num_hit,
            self.num_prompt - self.num_hit)
        return owners, rows


def prefill_to_dcp(engine: LLMEngine, to_ranks: list[Transport],
                   prompts: list[list[int]]) -> dict[str, Any]:
    """The prefill side: compute ``prompts`` (first token sampled), send each DCP rank the
    chunks it owns, free the blocks once every rank acknowledged. ``to_ranks[r]`` reaches DCP
    rank ``r`` (rank 0: the driver). Returns the first tokens, each request's block ids here
    and the bytes sent to each rank."""
    layout = KVCacheLayout.of_cache(engine.model.kv_cache, engine.config.block_size)
    for transport in to_ranks:
        handshake(transport, layout, "prefill", "decode")
    ids = [f"req{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        engine.add_request(req_id, prompt, max_new_tokens=2)  # kept running by hand below
    done: list[Any] = []
    while len(done) < len(ids):
        engine.step()
        running = engine.scheduler.running
        done += [req for req in running if req.output_token_ids]
        running[:] = [req for req in running if not req.output_token_ids]
    try:
        return _send_to_dcp(engine, to_ranks, prompts, ids)
    except PeerLostError:  # a rank is gone: nothing leaks here
        engine.manager.free_many([r for r in ids if r in engine.manager])
        raise


def _send_to_dcp(engine: LLMEngine, to_ranks: list[Transport], prompts: list[list[int]],
                 ids: list[str]) -> dict[str, Any]:
    own = [np.asarray(engine.manager.block_ids(r)[0], dtype=np.int64) for r in ids]
    tokens = [np.array([*p, engine.requests[r].output_token_ids[0]], np.int64)
              for r, p in zip(ids, prompts)]
    offer = OfferBatch(tuple(ids), np.concatenate(tokens), _starts([t.size for t in tokens]),
                       np.full(len(ids), 2, np.int64))
    to_ranks[0].send_message(offer)
    plan: DcpPlan = to_ranks[0].recv_message()
    src, _ = chunk_rows_many(np.concatenate(own), None, np.array([o.size for o in own]),
                             engine.config.block_size, plan.chunk_tokens, plan.num_hit,
                             plan.num_prompt - plan.num_hit)
    owners, _ = plan.chunks()
    kv_cache, staging = engine.model.kv_cache, StagingBuffer(1 << 62)  # one piece per rank
    sent = []
    for r, transport in enumerate(to_ranks):
        rows = src[owners == r]  # rank r's chunks, in token order
        transport.send_tensors([torch.from_numpy(data_status(True, max(rows.size, 1))),
                                *staging.gather(kv_cache, rows, plan.chunk_tokens)])
        sent.append(int(rows.size) * _row_bytes(kv_cache, plan.chunk_tokens))
    for transport in to_ranks:  # every rank holds its share: only now free the blocks
        if transport.recv_message() != "received":
            raise RuntimeError(f"protocol error: the {transport.peer} did not acknowledge")
    engine.manager.free_many(ids)
    return {"first_tokens": [engine.requests[r].output_token_ids[0] for r in ids],
            "block_ids": [o.tolist() for o in own], "bytes_per_rank": sent}


def dcp_rank_receive(dcp_rank: int, kv_cache: torch.Tensor, block_size: int,
                     to_prefill: Transport, to_ranks: list[Transport | None],
                     manager: KVCacheManager | None = None, interleave: int = 1
                     ) -> tuple[DcpPlan, int]:
    """One DCP decode rank: receive the chunks it owns into ``kv_cache`` (its shard,
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``).

    DCP rank 0 (the driver) passes ``manager`` (the group's allocator, blocks of
    ``block_size * len(to_ranks)`` tokens) and ``interleave``; it admits the offers and sends
    the plan to the prefill side and to ``to_ranks[r]`` for every ``r > 0``. The others
    receive the plan from ``to_ranks[0]``. Returns the plan and the bytes received here."""
    layout = KVCacheLayout.of_cache(kv_cache, block_size)
    remote = handshake(to_prefill, layout, "decode", "prefill")
    if dcp_rank > 0:
        driver = to_ranks[0]
        assert driver is not None
        return _receive_share(dcp_rank, kv_cache, driver.recv_message(), to_prefill)
    if manager is None:
        raise ValueError("the DCP driver (rank 0) needs the group's allocator (manager)")
    offer: OfferBatch = to_prefill.recv_message()
    starts = offer.token_starts.tolist()
    ids = list(offer.req_ids)
    prompts = [offer.token_ids[starts[i]:starts[i + 1]] for i in range(len(ids))]
    hits = np.array(manager.add_requests(ids, prompts), dtype=np.int64)
    try:
        num_prompt = offer.num_prompt_tokens
        manager.allocate_many(ids, num_prompt - hits)
        # a request's blocks from its first token (the hit's, then the new ones)
        own = [np.asarray(manager.block_ids(r)[0], np.int64) for r in ids]
        plan = DcpPlan(np.concatenate(own), _starts([o.size for o in own]), hits, num_prompt,
                       len(to_ranks), interleave, block_size,
                       chunk_tokens_of(remote.kernel_block_size, layout.kernel_block_size,
                                       interleave))
        to_prefill.send_message(plan)
        for transport in to_ranks[1:]:
            assert transport is not None
            transport.send_message(plan)
        received = _receive_share(0, kv_cache, plan, to_prefill)
    except PeerLostError:  # the prefill side or a rank is gone: nothing leaks here
        manager.free_many(ids)
        raise
    manager.mark_computed_many(ids, num_prompt - hits)
    return received


def _receive_share(dcp_rank: int, kv_cache: torch.Tensor, plan: DcpPlan,
                   to_prefill: Transport) -> tuple[DcpPlan, int]:
    """Receive this rank's chunks (their rows by the plan) and scatter them; acknowledge."""
    owners, rows = plan.chunks()
    mine = rows[owners == dcp_rank]
    status = torch.empty(2, dtype=torch.int64)
    for _ in to_prefill.recv_tensors((status,)):
        pass
    StagingBuffer(1 << 62).scatter(kv_cache, mine, plan.chunk_tokens, int(status[1]),
                                   to_prefill.recv_tensors)
    to_prefill.send_message("received")
    return plan, int(mine.size) * _row_bytes(kv_cache, plan.chunk_tokens)


def _starts(counts: list[int]) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _row_bytes(kv_cache: torch.Tensor, chunk_tokens: int) -> int:
    view = chunk_view(kv_cache, chunk_tokens)
    return view.shape[0] * view.shape[2] * view.element_size()
