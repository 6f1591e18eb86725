"""How a request picks its next token: greedy, or seeded temperature / top-k / top-p sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling rule.

    Attributes
    ----------
    temperature : float
        0 for greedy (the first largest logit); else logits are divided by it and a token is
        drawn from the softmax, restricted by ``top_k`` and ``top_p``.
    top_k : int
        Keep the ``top_k`` largest logits (0: all).
    top_p : float
        Keep the smallest set of most likely tokens whose probabilities sum to ``>= top_p``
        (1.0: all).
    seed : int
        Seeds the request's own generator: its tokens do not depend on the other requests of
        a batch or on preemptions.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        """A cpu generator seeded with ``seed`` (``None`` when greedy)."""
        return None if self.greedy else torch.Generator().manual_seed(self.seed)


GREEDY = SamplingParams()


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> int:
    """One token from ``logits`` (float32 ``[vocab_size]`` on cpu) under ``params``."""
    if params.greedy:
        return int(logits.argmax())
    scaled = logits.double() / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep a token while the mass before it is short of top_p (the first is always kept)
        before = sorted_probs.cumsum(0) - sorted_probs
        drop = order[before >= params.top_p]
        probs[drop] = 0
    return int(torch.multinomial(probs, 1, generator=generator))
