"""The allocator benchmarks' scheduling scenario, as events independent of any allocator.

A batch of ``num_reqs`` running requests; every step the ``arrivals`` oldest finish and as many
arrive with ``prompt_len``-token prompts (every other one starts with the same
``shared_prefix_len`` tokens), and ``decode_blocks`` running requests (round robin) each gain
``block_size`` sampled tokens, i.e. cross a block boundary. ``benchmarks/bench_allocator.py``
and ``benchmarks/vs_vllm.py`` both drive their allocators from these events, so the two measure
the same work.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

Prompt = list[int] | np.ndarray


@dataclass
class StepEvents:
    finished: list[int]  # request ids that leave (the oldest running)
    new_ids: list[int]  # request ids that arrive
    prompts: list[Prompt]  # their prompts: int64 arrays, or lists of ints
    decoding: list[int]  # request ids that gain one block of sampled tokens
    sampled: np.ndarray  # int64 [len(decoding), block_size]: the sampled tokens


class AllocatorWorkload:
    """Steady-state arrivals, finishes and decode-block crossings (see the module docstring).

    Parameters
    ----------
    token_format : {"numpy", "list"}
        How prompts are handed out: int64 arrays, or Python lists (as vLLM's scheduler holds
        them).
    """

    def __init__(
        self,
        *,
        num_reqs: int = 1024,
        block_size: int = 16,
        prompt_len: int = 2048,
        shared_prefix_len: int = 1024,
        arrivals: int = 8,
        decode_blocks: int = 64,
        seed: int = 0,
        token_format: str = "numpy",
    ) -> None:
        if token_format not in ("numpy", "list"):
            raise ValueError(f"token_format must be 'numpy' or 'list', got {token_format!r}")
        self.num_reqs, self.block_size, self.prompt_len = num_reqs, block_size, prompt_len
        self.arrivals, self.decode_blocks = arrivals, decode_blocks
        self.token_format = token_format
        self.rng = np.random.default_rng(seed)
        self.shared = self.rng.integers(0, 32000, shared_prefix_len)
        self.next_id = 0
        self.arrivals_made = 0
        self.running: deque[int] = deque()  # oldest first
        self.decode_cursor: deque[int] = deque()

    def new_prompt(self) -> Prompt:
        self.arrivals_made += 1
        if self.arrivals_made % 2:
            rest = self.rng.integers(0, 32000, self.prompt_len - len(self.shared))
            prompt = np.concatenate((self.shared, rest))
        else:
            prompt = self.rng.integers(0, 32000, self.prompt_len)
        return prompt.tolist() if self.token_format == "list" else prompt

    def fill(self) -> list[tuple[int, Prompt]]:
        """The first batch: ``num_reqs`` requests ``(id, prompt)``, admitted in this order."""
        batch = []
        for _ in range(self.num_reqs):
            batch.append((self.next_id, self.new_prompt()))
            self.running.append(self.next_id)
            self.decode_cursor.append(self.next_id)
            self.next_id += 1
        return batch

    def next_step(self) -> StepEvents:
        """The next step's events; the arrivals count as running from the next step on."""
        finished = [self.running.popleft() for _ in range(self.arrivals)]
        finished_set = set(finished)
        self.decode_cursor = deque(r for r in self.decode_cursor if r not in finished_set)
        prompts = [self.new_prompt() for _ in range(self.arrivals)]
        new_ids = list(range(self.next_id, self.next_id + self.arrivals))
        self.next_id += self.arrivals
        decoding = []
        for _ in range(self.decode_blocks):
            req_id = self.decode_cursor.popleft()
            self.decode_cursor.append(req_id)
            decoding.append(req_id)
        sampled = self.rng.integers(0, 32000, (len(decoding), self.block_size))
        self.running.extend(new_ids)
        self.decode_cursor.extend(new_ids)
        return StepEvents(finished, new_ids, prompts, decoding, sampled)
