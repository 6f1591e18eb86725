"""Check the engine against transformers' own greedy ``generate`` on each prompt alone."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from blocktable.engine.model import HFLlama
from blocktable.engine.request import Request

LOGITS_RTOL = 1e-4
"""Bound on ``max |engine - reference|`` over a request's logits, relative to
``max(1, max |reference|)``. Both sides are float32 (our attention accumulates in float64, the
reference's in float32), so the observed gap is ~1e-6; 1e-4 leaves room for other kernels."""


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
    hf_model: HFLlama, prompt_token_ids: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logits from ``hf_model.generate`` (dense attention, own cache).

    Returns
    -------
    tokens : list of int
        ``max_new_tokens`` generated ids.
    logits : torch.Tensor
        float32 ``[max_new_tokens, vocab_size]`` on cpu, the logits each token came from.
    """
    device = hf_model.lm_head.weight.device
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.int64, device=device)
    out = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # never stop early, whatever the EOS setting
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_token_ids) :].tolist()
    logits = torch.stack([step_logits[0] for step_logits in out.logits]).float().cpu()
    return tokens, logits


def verify_requests(hf_model: HFLlama, requests: Iterable[Request]) -> list[Verification]:
    """Compare every request's tokens (and recorded logits) with :func:`reference_generate`."""
    results = []
    for req in requests:
        tokens, ref_logits = reference_generate(hf_model, req.prompt_token_ids, req.max_new_tokens)
        bound = LOGITS_RTOL * max(1.0, float(ref_logits.abs().max()))
        diff = float("nan")
        if len(req.logits) == len(tokens):
            diff = float((torch.stack(req.logits) - ref_logits).abs().max())
        results.append(Verification(req.req_id, req.output_token_ids == tokens, diff, bound))
    return results
