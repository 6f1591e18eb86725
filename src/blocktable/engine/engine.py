"""The step loop of a continuous-batching engine built on blocktable (``docs/integration.md``).

One :meth:`LLMEngine.step`:

1. the :class:`~blocktable.engine.scheduler.Scheduler` picks the batch and the allocator
   (:class:`~blocktable.allocator.KVCacheManager`) gives it blocks, preempting if needed;
2. positions, ``query_start_loc`` and the other per-step inputs are built with numpy in
   persistent (pinned) buffers: with the captured step, all of them straight into the step's
   staging buffer (the token ids and the logits' indices in its payload), which crosses to
   the device in one copy;
3. the block-table step (:class:`~blocktable.step.CapturedStep`): the allocator's update is
   applied to the host table, its changed entries are staged beside the batch, and one
   CUDA-graph replay copies the staging, commits the table and computes the slot mapping
   (numpy on the CPU). Indexed mode:
   each request keeps the allocator's row for its lifetime and ``row_of_batch`` says which row
   each batch entry reads. With ``captured_step=False``: ``table.apply``, ``table.commit`` and
   ``compute_slot_mapping``;
5. the model writes K/V by slot mapping and attends through the table, each request reading
   its own row (``row_of_batch``: no copy of the table per step);
6. sampling (greedy unless a request asks otherwise), ``mark_computed``, and requests that hit
   a stop token or their length free their blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

import numpy as np
import torch

from blocktable._triton import resolve_backend
from blocktable.allocator import AllocatorGroupSpec, KVCacheManager
from blocktable.config import GroupSpec
from blocktable.engine.batch_inputs import BatchInputBuffers, ModelInputs, staged_payload_words
from blocktable.engine.generation_request import Request
from blocktable.engine.host_cache import HostKVCache
from blocktable.engine.model import AttentionInputs, HFLlama, PagedLlama
from blocktable.engine.sampling import GREEDY, SamplingParams, sample_token
from blocktable.engine.scheduler import Scheduler, SchedulerOutput
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.step import CapturedStep


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine's KV cache, table and batches.

    Attributes
    ----------
    block_size : int
        Tokens per KV-cache block (allocator, table and kernels use the same size here).
    num_blocks : int
        Blocks in the KV-cache pool, the null block 0 included.
    max_num_reqs : int
        Table rows: the most requests running at once.
    token_budget : int
        Most tokens computed per step; prompts longer than this are prefilled in chunks.
    max_model_len : int
        Longest sequence (prompt plus generated tokens) a request may reach.
    enable_prefix_caching : bool
        Share full blocks between requests with the same prompt prefix.
    record_logits : bool
        Keep each sampled token's logits on the request (for verification).
    backend : {"auto", "triton", "torch"}
        Kernels for slot mapping, KV writes and decode-only attention steps. ``"auto"``:
        Triton on CUDA, torch on the CPU. ``"triton"`` on the CPU needs ``TRITON_INTERPRET=1``
        (tests use it to run the GPU code path without a GPU).
    captured_step : bool
        Run the block-table part of each step through :class:`blocktable.step.CapturedStep`
        (one staged write and one CUDA-graph replay on CUDA, numpy on the CPU); ``False``:
        ``apply``, ``commit`` and ``compute_slot_mapping`` one after the other. CUDA with the
        torch backend always takes the three calls.
    host_blocks : int
        Blocks of a host tier (0: none): cached blocks evicted from the pool are offloaded to
        host memory and restored on prefix hits (:class:`~blocktable.engine.host_cache.HostKVCache`).
    """

    block_size: int = 4
    num_blocks: int = 64
    max_num_reqs: int = 16
    token_budget: int = 32
    max_model_len: int = 256
    enable_prefix_caching: bool = True
    record_logits: bool = True
    backend: str = "auto"
    captured_step: bool = True
    host_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_reqs", "token_budget", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {self.host_blocks}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is null), got {self.num_blocks}")


@dataclass(frozen=True)
class StepResult:
    """What one step did."""

    step: int
    num_reqs: int  # requests in the batch
    num_tokens: int  # tokens computed
    num_blocks_used: int  # blocks held by running requests after scheduling
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    table_time_s: float  # host time of the table's step (update, commit, slot mapping)
    inputs_time_s: float = 0.0  # host time building the step's input tensors


StepHook = Callable[["LLMEngine", SchedulerOutput], None]


class _ForwardInputs(NamedTuple):
    """The model's token inputs for one step (views of fixed device buffers)."""

    input_ids: torch.Tensor  # on device, int64 [num_tokens]
    positions: torch.Tensor  # on device, int64 [num_tokens]
    logits_indices: torch.Tensor  # on device, int64 [num_reqs]


class LLMEngine:
    """Generation for many requests at once over a paged KV cache.

    Parameters
    ----------
    hf_model : LlamaForCausalLM
        The model (weights, norms, MLPs); its device is the engine's device.
    config : EngineConfig
        KV-cache and batch sizes.

    Examples
    --------
    >>> from blocktable.engine import EngineConfig, LLMEngine, tiny_llama
    >>> engine = LLMEngine(tiny_llama(), EngineConfig(block_size=4, num_blocks=32))
    >>> req = engine.add_request("a", [1, 2, 3, 4, 5], max_new_tokens=3)
    >>> while engine.has_unfinished():
    ...     _ = engine.step()
    >>> len(req.output_token_ids)
    3
    """

    def __init__(self, hf_model: HFLlama, config: EngineConfig) -> None:
        self.config = config
        self.device: torch.device = hf_model.lm_head.weight.device
        backend = resolve_backend(config.backend, self.device)
        self.model = PagedLlama(hf_model, config.num_blocks, config.block_size, backend)
        self.manager = KVCacheManager(
            [AllocatorGroupSpec(config.block_size, config.num_blocks)],
            config.max_num_reqs,
            enable_prefix_caching=config.enable_prefix_caching,
            max_model_len=config.max_model_len,
            host_blocks=config.host_blocks,
        )
        self.host_cache = (
            HostKVCache(self.model.kv_cache, config.host_blocks) if config.host_blocks else None
        )
        self.table = MultiGroupBlockTable(
            [GroupSpec(config.block_size, num_blocks=config.num_blocks)],
            max_num_reqs=config.max_num_reqs,
            max_model_len=config.max_model_len,
            max_num_batched_tokens=config.token_budget,
            device=self.device,
            backend=backend,
        )
        self.scheduler = Scheduler(self.manager, config.token_budget)
        self._inputs = BatchInputBuffers(config.max_num_reqs, config.token_budget, self.device)
        captured = config.captured_step and (backend == "triton" or self.device.type == "cpu")
        # the step's payload carries the token ids and the logits' indices: one copy a step
        self.captured_step = CapturedStep(self.table, payload_words=staged_payload_words(
            config.max_num_reqs, config.token_budget)) if captured else None
        self._no_batch = (np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int64))
        # every row of the device table (fixed address): attention reads rows by row_of_batch
        self._block_table = self.table.device_view(0, self.table.max_num_reqs)
        self.requests: dict[str, Request] = {}
        self.step_index = 0

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        stop_token_ids: Iterable[int] = (),
        sampling: SamplingParams = GREEDY,
    ) -> Request:
        """Queue a request; it is admitted by a later :meth:`step`.

        It finishes after ``max_new_tokens`` tokens or at the first of ``stop_token_ids``
        (kept as its last token); tokens are picked by ``sampling`` (greedy by default).

        Raises
        ------
        ValueError
            Duplicate id, empty prompt, ``max_new_tokens < 1``, or a request that could not
            fit: longer than ``max_model_len`` or needing more blocks than the pool has.
        """
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} was already added")
        if not prompt_token_ids or max_new_tokens < 1:
            raise ValueError(
                f"request {req_id!r}: need a non-empty prompt and max_new_tokens >= 1, got "
                f"{len(prompt_token_ids)} tokens and max_new_tokens={max_new_tokens}"
            )
        # The last generated token is never fed back, so the cache holds one token less.
        num_kv_tokens = len(prompt_token_ids) + max_new_tokens - 1
        num_blocks_needed = math.ceil(num_kv_tokens / self.config.block_size)
        too_long = num_kv_tokens > self.config.max_model_len
        if too_long or num_blocks_needed > self.config.num_blocks - 1:
            raise ValueError(
                f"request {req_id!r} needs {num_kv_tokens} tokens = {num_blocks_needed} blocks; "
                f"max_model_len={self.config.max_model_len}, the pool has "
                f"{self.config.num_blocks - 1} blocks (num_blocks={self.config.num_blocks} "
                "minus the null block)"
            )
        req = Request(req_id, [int(t) for t in prompt_token_ids], max_new_tokens, self.step_index,
                      stop_token_ids=frozenset(int(t) for t in stop_token_ids),
                      sampling=sampling)
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- one step
    def step(self, hook: StepHook | None = None) -> StepResult:
        """Schedule, update the table, run the model, sample: one engine step.

        ``hook(engine, batch)``, if given, runs after the table is committed and before the
        forward, when the table and the allocator hold exactly what this step reads.
        """
        batch = self.scheduler.schedule()
        if self.host_cache is not None:
            # Evicted blocks leave before anything writes them, restored ones arrive before
            # any layer reads them (on CUDA the compute stream waits on the copies' events).
            [transfers] = self.manager.take_transfers()
            self.host_cache.transfer(transfers)
        num_blocks_used = self.config.num_blocks - 1 - self.manager.num_free_blocks()
        if self.captured_step is not None:
            attn, inputs, table_time_s, inputs_time_s = self._captured_table_step(batch)
        else:
            attn, inputs, table_time_s, inputs_time_s = self._table_step(batch)
        finished: list[str] = []
        if attn is not None and inputs is not None:
            if hook is not None:
                hook(self, batch)
            # Each request's last token of the step predicts its next token.
            logits = self.model(inputs.input_ids, inputs.positions, attn, inputs.logits_indices)
            finished = self._update(batch, logits.cpu())
        elif hook is not None:
            hook(self, batch)
        result = StepResult(
            step=self.step_index,
            num_reqs=len(batch.scheduled),
            num_tokens=batch.num_tokens,
            num_blocks_used=num_blocks_used,
            preempted=tuple(r.req_id for r in batch.preempted),
            finished=tuple(finished),
            table_time_s=table_time_s,
            inputs_time_s=inputs_time_s,
        )
        self.step_index += 1
        return result

    def _table_step(
        self, batch: SchedulerOutput
    ) -> tuple[AttentionInputs | None, _ForwardInputs | None, float, float]:
        """apply, commit, then compute_slot_mapping on the step's device inputs; returns the
        attention inputs, the batch inputs, the table's and the inputs' host times (s)."""
        t0 = time.perf_counter()
        self.table.apply(self.manager.take_step_update())
        self.table.commit()
        table_time_s = time.perf_counter() - t0
        if not batch.scheduled:
            return None, None, table_time_s, 0.0
        t1 = time.perf_counter()
        starts, num_new, rows, input_ids = self._batch_lists(batch)
        inputs = self._inputs.fill(starts, num_new, rows, input_ids)
        t2 = time.perf_counter()
        slot_mapping = self.table.compute_slot_mapping(
            inputs.query_start_loc, inputs.positions, row_of_batch=inputs.row_of_batch,
            query_start_loc_cpu=inputs.query_start_loc_cpu,
        )[0]
        table_time_s += time.perf_counter() - t2
        assert slot_mapping is not None  # an attention group always has slots
        attn = AttentionInputs(
            slot_mapping=slot_mapping,
            block_table=self._block_table,
            row_of_batch=inputs.row_of_batch,
            seq_lens=inputs.seq_lens,
            query_start_loc=inputs.query_start_loc,
            **_query_len_bounds(num_new),
        )
        forward = _ForwardInputs(inputs.input_ids, inputs.positions, inputs.logits_indices)
        return attn, forward, table_time_s, t2 - t1

    def _captured_table_step(
        self, batch: SchedulerOutput
    ) -> tuple[AttentionInputs | None, _ForwardInputs | None, float, float]:
        """The same through the captured step: the batch and the model's inputs are built
        straight into the step's staging buffer (they cross to the device once, with the
        step), then the update is applied and staged and one replay runs (its host time is
        the table's time)."""
        step = self.captured_step
        assert step is not None
        t0 = time.perf_counter()
        update = self.manager.take_step_update()
        if not batch.scheduled:
            step.run(update, *self._no_batch)
            return None, None, time.perf_counter() - t0, 0.0
        t1 = time.perf_counter()
        starts, num_new, rows, input_ids = self._batch_lists(batch)
        inputs: ModelInputs = self._inputs.fill_staged(starts, num_new, rows, input_ids,
                                                       step.batch_views(), step.device_payload)
        t2 = time.perf_counter()
        out = step.run_staged(update, len(rows), inputs.num_tokens)
        table_time_s = (t1 - t0) + (time.perf_counter() - t2)
        slot_mapping = out.slot_mappings[0]
        assert slot_mapping is not None and out.seq_lens is not None
        attn = AttentionInputs(
            slot_mapping=slot_mapping,
            block_table=self._block_table,
            row_of_batch=out.row_of_batch,
            seq_lens=out.seq_lens,
            query_start_loc=out.query_start_loc,
            **_query_len_bounds(num_new),
        )
        forward = _ForwardInputs(inputs.input_ids, out.positions, inputs.logits_indices)
        return attn, forward, table_time_s, t2 - t1

    def _batch_lists(
        self, batch: SchedulerOutput
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """Per request: tokens already cached (int64), new tokens (int64), the table row
        (int32), each ``[num_reqs]`` on cpu; and the step's token ids, request after request.

        Only per-request numbers are gathered in Python (one numpy call for all three arrays);
        the buffers expand positions with numpy.
        """
        row_of = self.manager.row_of
        starts: list[int] = []
        num_new: list[int] = []
        rows: list[int] = []
        input_ids: list[int] = []
        for s in batch.scheduled:  # one pass, flat lists: cheaper than tuples per request
            starts.append(s.start)
            num_new.append(s.num_new_tokens)
            rows.append(row_of(s.request.req_id))
            input_ids += s.request.all_token_ids[s.start : s.start + s.num_new_tokens]
        n = len(starts)
        per_request = np.array(starts + num_new, dtype=np.int64)
        return per_request[:n], per_request[n:], np.array(rows, dtype=np.int32), input_ids

    def _update(self, batch: SchedulerOutput, logits: torch.Tensor) -> list[str]:
        """After the forward: record computed tokens, sample, finish. ``logits`` on cpu."""
        return sample_and_finish(
            self.manager, self.scheduler, batch, logits, self.step_index,
            self.config.record_logits,
        )


def sample_and_finish(
    manager: KVCacheManager,
    scheduler: Scheduler,
    batch: SchedulerOutput,
    logits: torch.Tensor,
    step_index: int,
    record_logits: bool,
) -> list[str]:
    """After a step's forward: mark its tokens computed (one batched call), sample (greedily
    unless a request says otherwise) for the requests whose step reached the end of their
    tokens, finish those that generated a stop token or ``max_new_tokens`` and append the
    others' tokens (one batched call); return the finished ids.

    ``logits``: float32 ``[num_reqs, vocab_size]`` on cpu, one row per scheduled request.
    """
    finished: list[str] = []
    scheduled = batch.scheduled
    if not scheduled:
        return finished
    manager.mark_computed_many(
        [s.request.req_id for s in scheduled], [s.num_new_tokens for s in scheduled]
    )
    tokens = logits.argmax(dim=-1).tolist()  # greedy: the first largest logit of each row
    going_on: list[str] = []  # requests that sampled a token and continue
    going_on_tokens: list[int] = []
    for i, (s, token) in enumerate(zip(scheduled, tokens)):
        req = s.request
        if req.first_step is None:
            req.first_step = step_index
        if not s.completes:
            req.num_prefill_chunks += 1
            continue  # a prefill chunk: nothing to sample yet
        if not req.sampling.greedy:
            token = sample_token(logits[i], req.sampling, req.generator)
        req.output_token_ids.append(token)
        if record_logits:
            req.logits.append(logits[i].clone())
        stopped = token in req.stop_token_ids
        if stopped or len(req.output_token_ids) == req.max_new_tokens:
            req.finish_reason = "stop" if stopped else "length"
            scheduler.finish(req)
            req.finish_step = step_index
            finished.append(req.req_id)
        else:
            going_on.append(req.req_id)
            going_on_tokens.append(token)
    if going_on:  # one token each: one call
        manager.append_token_ids_many(
            going_on, np.array(going_on_tokens, dtype=np.int64).reshape(-1, 1)
        )
    return finished


class _QueryLenBounds(TypedDict):
    max_query_len: int
    min_query_len: int


def _query_len_bounds(num_new: np.ndarray) -> _QueryLenBounds:
    """``max_query_len`` and ``min_query_len`` of a batch's new-token counts (int ``[num_reqs]``,
    not empty); on a decode step (all 1) one reduction."""
    most = int(np.maximum.reduce(num_new))
    fewest = most if most == 1 else int(np.minimum.reduce(num_new))
    return {"max_query_len": most, "min_query_len": fewest}
