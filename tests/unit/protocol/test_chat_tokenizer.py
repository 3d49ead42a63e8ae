"""The builtin chat tokenizer: the Python rendering equals its Jinja2 template, ids are bytes."""
from __future__ import annotations

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from motor.protocol import chat_tokenizer as ct

CHATS = [
    [],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief. ünïcödé ✓"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": [{"type": "text", "text": "one"},
                                  {"type": "image_url", "image_url": {"url": "x"}},
                                  {"type": "text", "text": "two"}]}],
    [{"role": "user", "content": None}, {"role": "assistant"}],
    [{"role": "user", "content": "literal <|im_end|> inside"}],
]


@pytest.fixture(scope="module")
def template():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(ct.CHAT_TEMPLATE)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_gen", [True, False])
def test_render_chat_equals_the_jinja_template(template, messages: list, add_gen: bool) -> None:
    assert ct.render_chat(messages, add_generation_prompt=add_gen) == \
        template.render(messages=messages, add_generation_prompt=add_gen)


def test_hi_is_21_tokens() -> None:
    ids = ct.encode(ct.render_chat([{"role": "user", "content": "hi"}]))
    assert len(ids) == 21
    assert ids[0] == ct.IM_START_ID and ids.count(ct.IM_END_ID) == 1 and ids[-1] == ord("\n")


def test_continue_final_message_drops_the_end_and_the_generation_prompt() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert ct.render_chat(msgs, continue_final_message=True) == \
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nThe answer is"


def test_encode_is_bytes_and_special_tokens() -> None:
    assert ct.encode("héllo") == list("héllo".encode())
    assert ct.encode("a<|im_end|>b<|endoftext|><|im_start|>") == \
        [97, ct.IM_END_ID, 98, ct.ENDOFTEXT_ID, ct.IM_START_ID]
    assert ct.encode("") == []
    assert max(ct.encode("".join(ct.SPECIAL_TOKENS) + "\xff")) < ct.VOCAB_SIZE
    assert ct.EOS_TOKEN_IDS[0] == ct.IM_END_ID


def test_bad_content_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="content"):
        ct.render_chat([{"role": "user", "content": 5}])
