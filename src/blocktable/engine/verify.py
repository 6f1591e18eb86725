"""Check the engine against transformers' own greedy ``generate`` on each prompt alone, with
the same stopping rules (the request's stop tokens and ``max_new_tokens``)."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from blocktable.engine.generation_request import Request
from blocktable.engine.model import HFLlama

LOGITS_RTOL = 1e-4
"""Bound on ``max |engine - reference|`` over a request's logits, relative to
``max(1, max |reference|)``. Both sides compute in float32 with different summation orders
(paged versus dense attention, varlen batches versus one prompt): the tiny model's gap is
~1e-6, a 30-layer model's ~5e-5 on logits of ~20; 1e-4 leaves room for other kernels."""


@dataclass(frozen=True)
class Verification:
    """One request compared with the dense reference."""

    req_id: str
    tokens_match: bool
    max_logits_diff: float  # max |engine - reference| over all sampled steps (nan if not kept)
    logits_bound: float  # the allowed diff: LOGITS_RTOL * max(1, max |reference logits|)

    @property
    def ok(self) -> bool:
        # nan (no logits recorded) compares False; then only the tokens count.
        logits_ok = self.max_logits_diff != self.max_logits_diff or (
            self.max_logits_diff <= self.logits_bound
        )
        return self.tokens_match and logits_ok


@torch.inference_mode()
def reference_generate(
    hf_model: HFLlama,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: Collection[int] = (),
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits from ``hf_model.generate`` (dense attention, own cache).

    Generation stops after the first of ``stop_token_ids`` (kept) or ``max_new_tokens``
    tokens, whatever the model's own EOS setting: with no stop tokens it runs to the length.

    Returns
    -------
    tokens : list of int
        The generated ids, at most ``max_new_tokens``.
    logits : torch.Tensor
        float32 ``[len(tokens), vocab_size]`` on cpu, the logits each token came from.
    """
    device = hf_model.lm_head.weight.device
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.int64, device=device)
    out = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        output_logits=True,
        return_dict_in_generate=True,
        **_greedy_kwargs(max_new_tokens, stop_token_ids),
    )
    tokens = out.sequences[0, len(prompt_token_ids) :].tolist()
    logits = torch.stack([step_logits[0] for step_logits in out.logits]).float().cpu()
    return tokens, logits


def _greedy_kwargs(max_new_tokens: int, stop_token_ids: Collection[int]) -> dict[str, object]:
    """``generate``'s options for greedy decoding that stops exactly where the engine does."""
    kwargs: dict[str, object] = {
        "max_new_tokens": max_new_tokens, "do_sample": False,
        # unset the model's sampling defaults (they would only warn under do_sample=False)
        "temperature": None, "top_p": None, "top_k": None,
    }
    if stop_token_ids:
        kwargs["eos_token_id"] = sorted(stop_token_ids)
    else:  # no stop token: never stop early, whatever the model's EOS setting
        kwargs["min_new_tokens"] = max_new_tokens
    return kwargs


@torch.inference_mode()
def timed_generate_batched(
    hf_model: HFLlama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Collection[int] = (),
    pad_token_id: int = 0,
) -> tuple[list[list[int]], float]:
    """``hf_model.generate`` over all ``prompts`` in one left-padded batch (a speed baseline).

    Returns each prompt's tokens (cut after its first stop token) and the wall time in
    seconds. Padding changes float rounding, so these tokens may differ from the one-prompt
    :func:`reference_generate` on a near-tie: use that one for checking.
    """
    device = hf_model.lm_head.weight.device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.int64)
        attention_mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    out = hf_model.generate(input_ids, attention_mask=attention_mask, pad_token_id=pad_token_id,
                            **_greedy_kwargs(max_new_tokens, stop_token_ids))
    elapsed_s = time.perf_counter() - t0
    tokens = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_token_ids), len(row))
        tokens.append(row[:cut])
    return tokens, elapsed_s


def verify_requests(hf_model: HFLlama, requests: Iterable[Request]) -> list[Verification]:
    """Compare every request's tokens (and recorded logits) with :func:`reference_generate`
    under the request's own stopping rules (greedy requests only: sampled tokens have no
    reference)."""
    results = []
    for req in requests:
        if not req.sampling.greedy:
            raise ValueError(f"request {req.req_id!r} was sampled (temperature "
                             f"{req.sampling.temperature}); only greedy requests can be verified")
        tokens, ref_logits = reference_generate(hf_model, req.prompt_token_ids, req.max_new_tokens,
                                                req.stop_token_ids)
        bound = LOGITS_RTOL * max(1.0, float(ref_logits.abs().max()))
        diff = float("nan")
        if len(req.logits) == len(tokens):
            diff = float((torch.stack(req.logits) - ref_logits).abs().max())
        results.append(Verification(req.req_id, req.output_token_ids == tokens, diff, bound))
    return results
