"""Decode context parallelism across processes: one scheduler on rank 0, a KV shard per rank.

One :meth:`DistributedEngine.step`:

1. rank 0 (the *driver*) schedules: its :class:`~blocktable.engine.scheduler.Scheduler` and
   allocator (blocks of ``block_size * world`` tokens, see :mod:`blocktable.group_layout`)
   decide the batch and its blocks, packed into a :class:`StepPlan` (the table update, the
   token ids, each request's start, new-token count and table row);
2. the plan is broadcast to every rank over a CPU (gloo) group; every rank checks that it is
   the plan of the step it expects, so no rank can run ahead or fall behind;
3. every rank applies the same update to its own table (the same block ids on every rank; its
   ``CPConfig`` maps the tokens of other ranks to ``PAD_SLOT_ID``), commits, maps slots and
   runs the model: it writes only the KV it owns, attends its shard, and the ranks merge the
   attention of every layer (:class:`~blocktable.engine.cp_model.CPPagedLlama`);
4. rank 0 samples (the other ranks get the sampled tokens as the next plan's token ids).

The other ranks run :meth:`DistributedEngine.serve` until the driver calls
:meth:`DistributedEngine.shutdown`. Construction is a handshake: every rank's settings are
gathered once and compared (:func:`~blocktable.context_parallel.agreement.agree`), so ranks
that disagree (on the interleave, the block size, the model...) fail at once, on every rank.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from blocktable._triton import resolve_backend
from blocktable.allocator import KVCacheManager
from blocktable.attention.cp_layout import local_seq_len
from blocktable.config import CPConfig
from blocktable.constants import PAD_SLOT_ID
from blocktable.context_parallel.agreement import agree
from blocktable.context_parallel.launch import report_step
from blocktable.engine.cp_model import CPPagedLlama, Merger
from blocktable.engine.dcp_plan import RankStats, StepPlan, check_cp_group
from blocktable.engine.engine import EngineConfig, StepResult, sample_and_finish
from blocktable.engine.generation_request import Request
from blocktable.engine.model import AttentionInputs, HFLlama
from blocktable.engine.sampling import GREEDY, SamplingParams
from blocktable.engine.scheduler import Scheduler, SchedulerOutput
from blocktable.group_layout import GroupLayout, build_specs
from blocktable.multi_group import MultiGroupBlockTable
from blocktable.step import CapturedStep

MERGE_PATTERNS = ("all_reduce", "all_gather_reduce_scatter", "all_to_all")
MERGE_TRANSPORTS = ("auto", "collectives", "p2p")
_FOREVER = timedelta(days=365)  # gloo takes a deadline per call: "none" is a far one


def make_merger(
    group: Any, cp: CPConfig, *, pattern: str, max_num_tokens: int, num_heads: int,
    head_dim: int, dtype: torch.dtype, device: torch.device, transport: str = "collectives",
    p2p_timeout_s: float | None = 60.0,
) -> Merger:
    """The :class:`blocktable.context_parallel.AttentionMerger` the engine uses by default
    (``transport`` and ``p2p_timeout_s`` as there)."""
    from blocktable.context_parallel import AttentionMerger

    merger: Merger = AttentionMerger(
        group, max_num_tokens=max_num_tokens, num_heads=num_heads, head_dim=head_dim,
        dtype=dtype, device=device, pattern=pattern, cp=cp, transport=transport,
        p2p_timeout_s=p2p_timeout_s,
    )
    return merger


StepHook = Callable[["DistributedEngine", SchedulerOutput], None]


class DistributedEngine:
    """Generation with each request's KV sharded over the ranks of a CP group.

    Every rank of ``group`` constructs one, at the same time (collective set-up). Rank 0
    accepts requests and calls :meth:`step`; the others call :meth:`serve`.

    Parameters
    ----------
    hf_model : LlamaForCausalLM
        The model, with the same weights on every rank, on this rank's device.
    config : EngineConfig
        ``block_size`` is the table's block size (tokens per physical block on each rank);
        ``num_blocks`` is each rank's pool (the same ids on every rank). The allocator uses
        blocks of ``block_size * world`` tokens, so the ranks together hold
        ``(num_blocks - 1) * block_size * world`` tokens.
    cp : CPConfig
        This rank's world size, rank and interleave; must agree with ``group``.
    group : torch.distributed.ProcessGroup
        The CP group (gloo on the CPU, NCCL on GPUs): attention is merged over it.
    kernel_block_size : int or None
        Block size of the KV cache and attention kernel; divides ``config.block_size``.
    merger : Merger or None
        Attention merger; default an ``AttentionMerger`` with ``merge_pattern``.
    merge_pattern : str
        ``"all_reduce"`` (default: the model is replicated, every rank needs all heads),
        ``"all_gather_reduce_scatter"`` or ``"all_to_all"`` (then gathered over heads).
    merge_transport : str
        How the default merger moves the partial outputs between the ranks:
        ``"collectives"`` (NCCL or gloo collectives on ``group``), ``"p2p"`` (one kernel per
        merge that writes into the peers' GPU memory; every rank a GPU of one node) or
        ``"auto"`` (default): ``"p2p"`` where every rank can run it, else ``"collectives"``,
        decided by all ranks together. The choice is :attr:`merge_transport`.
    merge_p2p_timeout_s : float or None
        With the p2p transport, how long a merge waits for a peer before its kernel traps
        (the process then ends with a CUDA error instead of hanging); ``None`` waits forever
        (for a debugger that stops a rank). Keep it above any pause of one rank between two
        merges of the others.
    control_group : torch.distributed.ProcessGroup or None
        A gloo group over the same ranks for the step plans; default ``group`` if it is gloo,
        else a new gloo group (``torch.distributed.new_group``, collective over all processes).
    check_consistency : bool
        Every step, gather every rank's greedy tokens and raise if any rank differs (debug).
    idle_timeout_s : float or None
        How long :meth:`serve` waits for the driver's next plan. ``None`` (default): as long
        as the driver lives; a driver that dies closes its connections, which ends the wait
        at once. The wait has its own deadline, not the process group's timeout, so a driver
        may stay idle (no request) for as long as it likes.

    Raises
    ------
    ConfigMismatchError
        On every rank: the ranks disagree on a setting they must share (interleave, block
        size, pool, token budget, model shape, dtype or weights, merge pattern...).
    ValueError
        ``cp`` disagrees with ``group`` (see :func:`check_cp_group`), or the interleave does
        not divide ``config.block_size``.
    """

    def __init__(
        self,
        hf_model: HFLlama,
        config: EngineConfig,
        cp: CPConfig,
        group: Any,
        *,
        kernel_block_size: int | None = None,
        merger: Merger | None = None,
        merge_pattern: str = "all_reduce",
        merge_transport: str = "auto",
        merge_p2p_timeout_s: float | None = 60.0,
        control_group: Any = None,
        check_consistency: bool = False,
        idle_timeout_s: float | None = None,
    ) -> None:
        import torch.distributed as dist

        check_cp_group(cp, group)
        if merge_pattern not in MERGE_PATTERNS:
            raise ValueError(f"merge_pattern must be one of {MERGE_PATTERNS}, got {merge_pattern!r}")
        if merge_transport not in MERGE_TRANSPORTS:
            raise ValueError(
                f"merge_transport must be one of {MERGE_TRANSPORTS}, got {merge_transport!r}"
            )
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 or None, got {idle_timeout_s}")
        self.config, self.cp, self.group = config, cp, group
        self.device: torch.device = hf_model.lm_head.weight.device
        if control_group is None:
            control_group = group if dist.get_backend(group) == "gloo" else dist.new_group(
                dist.get_process_group_ranks(group), backend="gloo"
            )
        elif dist.get_process_group_ranks(control_group) != dist.get_process_group_ranks(group):
            raise ValueError("control_group must hold the same ranks as group")
        self.control_group = control_group
        self._idle_timeout = _FOREVER if idle_timeout_s is None else timedelta(
            seconds=idle_timeout_s)
        hf_config = hf_model.config
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        weights = hf_model.lm_head.weight
        agree(control_group, "DistributedEngine", {
            "interleave": cp.interleave, "block_size": config.block_size,
            "num_blocks": config.num_blocks, "kernel_block_size": kernel_block_size,
            "max_num_reqs": config.max_num_reqs, "max_model_len": config.max_model_len,
            "token_budget": config.token_budget, "backend": config.backend,
            "captured_step": config.captured_step,
            "model": (type(hf_model).__name__, hf_config.num_hidden_layers, num_heads,
                      hf_config.num_key_value_heads, head_dim, hf_config.hidden_size,
                      hf_config.vocab_size),
            "model dtype": str(weights.dtype),
            # A sample of the weights, summed on the host (the same bits on every rank).
            "weights sample": repr(float(weights[:8].detach().to("cpu", torch.float64).sum())),
            "merge_pattern": merge_pattern, "merge_transport": merge_transport,
            "merger": None if merger is None else type(merger).__name__,
            "check_consistency": check_consistency, "device type": self.device.type,
        })
        self.is_driver = cp.rank == 0
        self.check_consistency = check_consistency
        backend = resolve_backend(config.backend, self.device)
        self.layout = GroupLayout(config.block_size, config.num_blocks, kernel_block_size)
        (alloc_spec,), (table_spec,) = build_specs([self.layout], cp)
        self.allocator_block_size = alloc_spec.block_size
        self.manager: KVCacheManager | None = None
        self.scheduler: Scheduler | None = None
        if self.is_driver:
            self.manager = KVCacheManager(
                [alloc_spec], config.max_num_reqs,
                enable_prefix_caching=config.enable_prefix_caching,
                max_model_len=config.max_model_len,
            )
            self.scheduler = Scheduler(self.manager, config.token_budget)
        self.table = MultiGroupBlockTable(
            [table_spec], max_num_reqs=config.max_num_reqs, max_model_len=config.max_model_len,
            max_num_batched_tokens=config.token_budget, device=self.device, cp=cp,
            backend=backend,
        )
        captured = config.captured_step and (backend == "triton" or self.device.type == "cpu")
        self.captured_step = CapturedStep(self.table) if captured else None
        if merger is None:
            merger = make_merger(
                group, cp, pattern=merge_pattern, max_num_tokens=config.token_budget,
                num_heads=num_heads, head_dim=head_dim, dtype=hf_model.lm_head.weight.dtype,
                device=self.device, transport=merge_transport,
                p2p_timeout_s=merge_p2p_timeout_s,
            )
        self.merge_transport: str = getattr(merger, "transport", "custom")
        """The merger's transport: ``"collectives"``, ``"p2p"`` or ``"custom"`` (a merger
        without a ``transport`` attribute was handed over)."""
        kernel_block_size = table_spec.kernel_block_size or table_spec.block_size
        self.model = CPPagedLlama(
            hf_model, config.num_blocks * (config.block_size // kernel_block_size),
            kernel_block_size, backend, cp=cp, cp_block_size=config.block_size, merger=merger,
        )
        self._driver_rank = dist.get_global_rank(control_group, 0)
        self.requests: dict[str, Request] = {}
        self.step_index = 0
        self.stats = RankStats(
            cp.rank, cp.world_size,
            kv_cache_bytes=self.model.kv_cache.numel() * self.model.kv_cache.element_size(),
        )
        self._kv_tokens_written = torch.zeros((), dtype=torch.int64, device=self.device)

    # ---------------------------------------------------------------- driver: requests
    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        stop_token_ids: Iterable[int] = (),
        sampling: SamplingParams = GREEDY,
    ) -> Request:
        """Queue a request (driver only); it is admitted by a later :meth:`step`.

        It finishes after ``max_new_tokens`` tokens or at the first of ``stop_token_ids``
        (kept as its last token); rank 0 picks its tokens by ``sampling`` (greedy by default)
        from the merged logits, as :meth:`blocktable.engine.LLMEngine.add_request` does.

        Raises
        ------
        ValueError
            Duplicate id, empty prompt, ``max_new_tokens < 1``, or a request longer than
            ``max_model_len`` or needing more allocator blocks than the pool has.
        """
        scheduler = self._driver_part("add_request")
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} was already added")
        if not prompt_token_ids or max_new_tokens < 1:
            raise ValueError(
                f"request {req_id!r}: need a non-empty prompt and max_new_tokens >= 1, got "
                f"{len(prompt_token_ids)} tokens and max_new_tokens={max_new_tokens}"
            )
        num_kv_tokens = len(prompt_token_ids) + max_new_tokens - 1
        num_blocks_needed = math.ceil(num_kv_tokens / self.allocator_block_size)
        if num_kv_tokens > self.config.max_model_len or num_blocks_needed > self.config.num_blocks - 1:
            raise ValueError(
                f"request {req_id!r} needs {num_kv_tokens} tokens = {num_blocks_needed} blocks "
                f"of {self.allocator_block_size} tokens; max_model_len="
                f"{self.config.max_model_len}, the pool has {self.config.num_blocks - 1} blocks"
            )
        req = Request(req_id, [int(t) for t in prompt_token_ids], max_new_tokens, self.step_index,
                      stop_token_ids=frozenset(int(t) for t in stop_token_ids),
                      sampling=sampling)
        self.requests[req_id] = req
        scheduler.add(req)
        return req

    def has_unfinished(self) -> bool:
        return self._driver_part("has_unfinished").has_unfinished()

    # ---------------------------------------------------------------- driver: steps
    def step(self, hook: StepHook | None = None) -> StepResult:
        """Schedule, broadcast the plan, run the sharded model, sample (driver only).

        ``hook(engine, batch)`` runs after the table is committed and before the forward.
        """
        scheduler = self._driver_part("step")
        assert self.manager is not None
        batch = scheduler.schedule()
        num_blocks_used = self.config.num_blocks - 1 - self.manager.num_free_blocks()
        plan = self._plan(batch)
        self._broadcast(plan)
        logits, table_time_s = self._execute(plan, lambda: hook(self, batch) if hook else None)
        report_step(self.step_index)
        finished = self._update(batch, logits) if logits is not None else []
        result = StepResult(
            step=self.step_index, num_reqs=len(batch.scheduled), num_tokens=batch.num_tokens,
            num_blocks_used=num_blocks_used, preempted=tuple(r.req_id for r in batch.preempted),
            finished=tuple(finished), table_time_s=table_time_s,
        )
        self.step_index += 1
        return result

    def shutdown(self) -> None:
        """Tell the other ranks to leave :meth:`serve` (driver only; call once, at the end)."""
        self._driver_part("shutdown")
        self._broadcast(StepPlan(self.step_index, None, stop=True))

    # ---------------------------------------------------------------- followers
    def serve(self) -> RankStats:
        """Run the driver's plans until it calls :meth:`shutdown` (ranks other than 0).

        Between plans it waits as long as ``idle_timeout_s`` allows (by default as long as the
        driver lives), not the process group's timeout.
        """
        if self.is_driver:
            raise RuntimeError("serve() is for ranks other than 0; rank 0 calls step()")
        while True:
            plan = self._receive()
            if plan.stop:
                return self.finish_stats()
            self._execute(plan, None)
            report_step(self.step_index)
            self.step_index += 1

    def finish_stats(self) -> RankStats:
        """This rank's :class:`RankStats` (synchronizes with the device)."""
        self.stats.kv_tokens_written = int(self._kv_tokens_written)
        self.stats.num_empty_queries = int(self.model.num_empty_queries)
        self.stats.num_steps = self.step_index
        return self.stats

    # ---------------------------------------------------------------- internals
    def _driver_part(self, what: str) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError(f"{what}() runs on rank 0 (the driver); this is rank {self.cp.rank}")
        return self.scheduler

    def _plan(self, batch: SchedulerOutput) -> StepPlan:
        assert self.manager is not None
        update = self.manager.take_step_update()
        if not batch.scheduled:
            return StepPlan(self.step_index, update)
        per_req = np.array(
            [(s.start, s.num_new_tokens, self.manager.row_of(s.request.req_id))
             for s in batch.scheduled],
            dtype=np.int64,
        ).T
        input_ids = np.fromiter(
            (t for s in batch.scheduled
             for t in s.request.all_token_ids[s.start : s.start + s.num_new_tokens]),
            dtype=np.int64, count=batch.num_tokens,
        )
        return StepPlan(self.step_index, update, input_ids, per_req[0], per_req[1],
                        per_req[2].astype(np.int32))

    # A plan travels as a header (step, bytes) then its pickle. Followers wait for the header
    # with the idle deadline (the driver may have no work for long); the pickle follows at
    # once, within the group's timeout.
    def _bcast(self, tensor: torch.Tensor, timeout: timedelta | None) -> None:
        import torch.distributed as dist

        opts = dist.distributed_c10d.BroadcastOptions()
        opts.rootRank = dist.get_group_rank(self.control_group, self._driver_rank)
        if timeout is not None:
            opts.timeout = timeout
        self.control_group.broadcast([tensor], opts).wait()

    def _broadcast(self, plan: StepPlan) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
        self._bcast(torch.tensor([plan.step, payload.numel()], dtype=torch.int64), None)
        self._bcast(payload, None)

    def _receive(self) -> StepPlan:
        header = torch.zeros(2, dtype=torch.int64)
        self._bcast(header, self._idle_timeout)
        step, nbytes = header.tolist()
        payload = torch.empty(nbytes, dtype=torch.uint8)
        self._bcast(payload, None)  # taken even when refused: the next call stays paired
        if step != self.step_index:
            raise RuntimeError(
                f"rank {self.cp.rank} expected the plan of step {self.step_index}, got step "
                f"{step}: the ranks diverged"
            )
        plan = pickle.loads(payload.numpy().tobytes())
        if not isinstance(plan, StepPlan) or plan.step != step:
            raise TypeError(f"rank {self.cp.rank}: expected the StepPlan of step {step}, got "
                            f"{type(plan).__name__}")
        return plan

    def _execute(
        self, plan: StepPlan, hook: Callable[[], None] | None
    ) -> tuple[torch.Tensor | None, float]:
        """Apply, commit, map slots, run the model: the same on every rank. Logits on cpu."""
        assert plan.update is not None
        num_reqs = len(plan.rows)
        dev = self.device
        step = self.captured_step
        if step is not None:  # one staged write and one replay (numpy on the CPU)
            qsl = np.zeros(num_reqs + 1, dtype=np.int32)
            qsl[1:] = np.cumsum(plan.num_new_tokens)
            num_tokens = int(qsl[-1])
            positions_np = np.repeat(plan.starts - qsl[:-1], plan.num_new_tokens)
            positions_np += np.arange(num_tokens, dtype=np.int64)
            seq_lens_np = (plan.starts + plan.num_new_tokens).astype(np.int32)
            t0 = time.perf_counter()
            out = step.run(plan.update, qsl, positions_np, plan.rows.astype(np.int32),
                           seq_lens_np)
            table_time_s = time.perf_counter() - t0
            if num_reqs == 0:
                if hook is not None:
                    hook()
                return None, table_time_s
            slot_mapping, query_start_loc = out.slot_mappings[0], out.query_start_loc
            positions, row_of_batch, seq_lens = out.positions, out.row_of_batch, out.seq_lens
            assert seq_lens is not None
        else:
            t0 = time.perf_counter()
            self.table.apply(plan.update)
            self.table.commit()
            table_time_s = time.perf_counter() - t0
            if num_reqs == 0:
                if hook is not None:
                    hook()
                return None, table_time_s
            num_new = torch.from_numpy(plan.num_new_tokens)
            qsl_cpu = torch.zeros(num_reqs + 1, dtype=torch.int32)
            qsl_cpu[1:] = torch.cumsum(num_new, 0)
            num_tokens = int(qsl_cpu[-1])
            query_start_loc = qsl_cpu.to(dev)
            start = torch.from_numpy(plan.starts).to(dev)
            positions = torch.repeat_interleave(
                start - query_start_loc[:-1], num_new.to(dev), output_size=num_tokens
            ) + torch.arange(num_tokens, device=dev)
            seq_lens = (start + num_new.to(dev)).to(torch.int32)
            row_of_batch = torch.from_numpy(plan.rows).to(dev)
            t1 = time.perf_counter()
            slot_mapping = self.table.compute_slot_mapping(
                query_start_loc, positions, row_of_batch=row_of_batch,
                query_start_loc_cpu=qsl_cpu,
            )[0]
            table_time_s += time.perf_counter() - t1
        assert slot_mapping is not None
        self._kv_tokens_written += (slot_mapping[:num_tokens] != PAD_SLOT_ID).sum()
        local = local_seq_len(
            plan.starts + plan.num_new_tokens, world_size=self.cp.world_size, rank=self.cp.rank,
            interleave=self.cp.interleave, manager_block_size=self.config.block_size,
        )
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, int(np.sum(local)))
        attn = AttentionInputs(
            slot_mapping=slot_mapping,
            block_table=self.table.device_view(0, self.table.max_num_reqs),
            row_of_batch=row_of_batch,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=int(plan.num_new_tokens.max()),
            min_query_len=int(plan.num_new_tokens.min()),
        )
        if hook is not None:
            hook()
        input_ids = torch.from_numpy(plan.input_ids).to(dev)
        self.model.step = self.step_index
        logits = self.model(input_ids, positions, attn, query_start_loc[1:].long() - 1).cpu()
        if self.check_consistency:
            self._check_same_tokens(logits.argmax(-1))
        return logits, table_time_s

    def _check_same_tokens(self, tokens: torch.Tensor) -> None:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.cp.world_size
        dist.all_gather_object(gathered, tokens.tolist(), group=self.control_group)
        for r, other in enumerate(gathered):
            if other != gathered[0]:
                raise RuntimeError(
                    f"step {self.step_index}: rank {r} would sample {other}, rank 0 samples "
                    f"{gathered[0]}: the merged attention differs between ranks"
                )

    def _update(self, batch: SchedulerOutput, logits: torch.Tensor) -> list[str]:
        """Record computed tokens, sample, finish (as the single-process engine)."""
        assert self.manager is not None and self.scheduler is not None
        return sample_and_finish(
            self.manager, self.scheduler, batch, logits, self.step_index,
            self.config.record_logits,
        )
