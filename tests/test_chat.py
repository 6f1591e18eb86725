"""Chat prompts: the template's rendering as ids, stop tokens, and follow-up turns that extend
the first turn's tokens (so its KV cache is reused) only when the answer re-tokenizes the same."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blocktable.engine.chat import encode_chat, follow_up, model_stop_token_ids


class CharTokenizer:
    """One id per character (``<e>`` is the end-of-turn marker), and a ChatML-like template."""

    chat_template = "chatml"
    eos_token_id = 1
    END = "<e>"

    def __init__(self, merge: str | None = None) -> None:
        self.merge = merge  # a two-character string tokenized as one id (breaks round trips)

    def get_vocab(self) -> dict[str, int]:
        return {self.END: 1, "<|im_end|>": 7}

    def apply_chat_template(self, messages: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> str:
        assert not tokenize
        text = "".join(f"[{m['role']}]{m['content']}{self.END}" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith(self.END, i):
                ids.append(1)
                i += len(self.END)
            elif self.merge and text.startswith(self.merge, i):
                ids.append(1000)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return {"input_ids": ids}

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(chr(i) for i in ids if i != 1)


SYSTEM = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_encode_chat_renders_the_template() -> None:
    tok = CharTokenizer()
    ids = encode_chat(tok, SYSTEM)
    assert tok.decode(ids, True) == "[system]be brief[user]hi[assistant]"
    assert ids.count(1) == 2  # the end-of-turn markers are single ids
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(tok, SYSTEM)


def test_stop_tokens_gather_eos_and_end_of_turn() -> None:
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[3, 4]))
    assert model_stop_token_ids(model, CharTokenizer()) == {1, 3, 4, 7}


def test_follow_up_extends_the_first_turn() -> None:
    tok = CharTokenizer()
    answer = [ord(c) for c in "hello"] + [1]  # generated, ending at end-of-turn
    ids, reused = follow_up(tok, SYSTEM, answer, "more?", frozenset({1}))
    first = encode_chat(tok, SYSTEM) + answer
    assert reused and ids[: len(first)] == first
    assert tok.decode(ids, True).endswith("[user]more?[assistant]")


def test_follow_up_says_when_the_answer_re_tokenizes_differently() -> None:
    tok = CharTokenizer(merge="ll")  # "hello" generated char by char renders as h e ll o
    answer = [ord(c) for c in "hello"] + [1]
    ids, reused = follow_up(tok, SYSTEM, answer, "more?", frozenset({1}))
    assert not reused and 1000 in ids
