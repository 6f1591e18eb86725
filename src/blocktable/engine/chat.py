"""Chat prompts as token ids: the tokenizer's chat template, stop tokens, multi-turn follow-ups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>")
"""Chat templates' end-of-turn markers, looked up in the vocabulary (those it has stop)."""


def encode_chat(tokenizer: Any, messages: Sequence[Message], *,
                add_generation_prompt: bool = True) -> list[int]:
    """``messages`` rendered by the tokenizer's chat template, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    # the template writes the special tokens itself (no second BOS)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def model_stop_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end an answer: the generation config's and tokenizer's EOS, and the chat
    template's end-of-turn marker when the vocabulary has one."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return frozenset(int(i) for i in ids)


def follow_up(
    tokenizer: Any,
    messages: Sequence[Message],
    answer_token_ids: Sequence[int],
    question: str,
    stop_token_ids: frozenset[int],
) -> tuple[list[int], bool]:
    """The next turn's prompt: ``messages``, the answer, then ``question``.

    Returns the token ids and whether they start with the first turn's prompt and answer
    token for token (so the first turn's KV cache is reused): true when the template renders
    the answer back to the tokens the model generated.
    """
    answer = [t for t in answer_token_ids if t not in stop_token_ids]
    text = tokenizer.decode(answer, skip_special_tokens=True)
    turn = [*messages, {"role": "assistant", "content": text},
            {"role": "user", "content": question}]
    ids = encode_chat(tokenizer, turn)
    first = encode_chat(tokenizer, messages) + list(answer_token_ids)
    return ids, ids[: len(first)] == first
