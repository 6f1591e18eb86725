"""One generation request as the engine sees it: its tokens, its state, its history."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from blocktable.engine.sampling import GREEDY, SamplingParams


class RequestStatus(str, enum.Enum):
    """Where a request is in its life: waiting -> running (<-> preempted) -> finished."""

    WAITING = "waiting"  # queued, holds no row and no blocks
    RUNNING = "running"  # holds a table row and blocks in the allocator
    PREEMPTED = "preempted"  # its blocks were taken back; it waits to be recomputed
    FINISHED = "finished"  # hit a stop token or max_new_tokens; row and blocks freed


@dataclass(eq=False)
class Request:
    """A prompt to continue until a stop token or ``max_new_tokens`` tokens.

    Attributes
    ----------
    req_id : str
        Unique id; also the allocator's key.
    prompt_token_ids : list of int
        The prompt, at least one token.
    max_new_tokens : int
        Most tokens to generate; the request finishes after the last one.
    stop_token_ids : frozenset of int
        Tokens that end the request once generated (the model's end-of-turn, EOS, its own);
        a stop token is kept as the last output token, as ``transformers.generate`` does.
    sampling : SamplingParams
        Greedy by default.
    finish_reason : {"stop", "length"} or None
        Why it finished: a stop token, or ``max_new_tokens``.
    output_token_ids : list of int
        Tokens generated so far.
    logits : list of torch.Tensor
        float32 ``[vocab_size]`` on cpu, the logits each output token was sampled from
        (kept only when the engine records logits).
    num_preemptions : int
        Times the request lost its blocks and was recomputed.
    num_cached_tokens : int
        Prompt tokens served by the prefix cache, summed over its admissions.
    num_prefill_chunks : int
        Steps that computed part of the known tokens without reaching their end (chunked
        prefill, or the recompute after a preemption).
    arrival_step : int
        Engine step at which it was added.
    first_step, finish_step : int or None
        Engine steps at which it was first scheduled and at which it finished.
    """

    req_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_prefill_chunks: int = 0
    first_step: int | None = None
    finish_step: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = GREEDY
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # on cpu; seeded from sampling.seed

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = self.sampling.make_generator()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens: what a resumed request must have in its KV cache."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Known tokens (prompt plus generated)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
