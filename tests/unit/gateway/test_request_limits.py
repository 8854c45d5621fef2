"""RequestLimits and the tokenizer's batch path, in this process: the defaults and the message size,
and a batch that equals encode and refuses prompts over the limit (the gateway's refusals on a
real cluster: tests/integration/test_gateway_limits.py)."""

from __future__ import annotations

import pytest
from cluster_helpers import big_text, write_chat_model

from splitserve.common.tokenizer import TooManyTokens, load_tokenizer
from splitserve.gateway.validation import RequestLimits


@pytest.fixture(scope="module")
def chat_model_dir(tiny_llama_dir, tmp_path_factory):
    return write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("chat") / "tiny-llama-chat")


def test_request_limits_defaults_and_message_size():
    limits = RequestLimits()
    assert (limits.max_prompt_bytes, limits.max_stop_bytes, limits.max_stop_total_bytes) == (1 << 20, 1 << 10, 16 << 10)
    assert limits.max_message_bytes == 4 << 20  # gRPC's default covers the default limits
    assert RequestLimits(max_prompt_bytes=8 << 20).max_message_bytes > 8 << 20
    with pytest.raises(ValueError, match="max_stops"):
        RequestLimits(max_stops=0)


def test_tokenizer_batch_path_equals_encode_and_refuses_long_prompts(chat_model_dir):
    tokenizer = load_tokenizer(chat_model_dir)
    text = big_text(10_000) + " \x00 e\u0301 \U0001f308"
    ids = tokenizer.encode(text)
    assert ids == tokenizer.backend.encode(text).ids  # the batch call equals the plain one
    assert tokenizer.encode(text, max_num_tokens=len(ids)) == ids
    with pytest.raises(TooManyTokens) as err:
        tokenizer.encode(text, max_num_tokens=len(ids) - 1)
    assert err.value.num_tokens == len(ids)
    chat = [{"role": "user", "content": text}]
    assert (
        tokenizer.encode_chat(chat)
        == tokenizer.backend.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False).ids
    )
    with pytest.raises(ValueError, match="chat template rejected"):
        tokenizer.encode_chat([{"role": "tool", "content": "hi"}])


# -- big prompts and the event loop ---------------------------------------------------------------------
