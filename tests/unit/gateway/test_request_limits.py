"""The gateway refuses bad requests itself, cheaply, before they cost the event loop or a worker:
sizes before tokenizing, token ids against the workers' vocabulary, non-finite sampling values,
chat-template errors; and a big prompt that is tokenized does not stall other streams.

Real gateway + one unified worker on 127.0.0.1 (tiny Llama with a small chat template).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import collect, engine_argv, greedy_request, stub, tokens

from splitserve.common.tokenizer import TooManyTokens, load_tokenizer
from splitserve.gateway.validation import RequestLimits
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

# Roles the template knows; "tool" hits raise_exception, "ghost" an undefined attribute (UndefinedError).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'ghost' %}{{ m.nothing.deeper }}{% endif %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'ghost'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_chat_model(src, dst):
    """A copy of a tiny model folder with CHAT_TEMPLATE in its tokenizer_config.json."""
    shutil.copytree(src, dst)
    (dst / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return dst


def big_text(num_bytes: int) -> str:
    words, rng = "the quick brown fox jumps over the lazy dog paged attention".split(), random.Random(0)
    return " ".join(rng.choices(words, k=num_bytes // 3))[:num_bytes]


@pytest.fixture(scope="module")
def chat_model_dir(tiny_llama_dir, tmp_path_factory):
    return write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("chat") / "tiny-llama-chat")










@pytest.mark.unit
def test_request_limits_defaults_and_message_size():
    limits = RequestLimits()
    assert (limits.max_prompt_bytes, limits.max_stop_bytes, limits.max_stop_total_bytes) == (1 << 20, 1 << 10, 16 << 10)
    assert limits.max_message_bytes == 4 << 20  # gRPC's default covers the default limits
    assert RequestLimits(max_prompt_bytes=8 << 20).max_message_bytes > 8 << 20
    with pytest.raises(ValueError, match="max_stops"):
        RequestLimits(max_stops=0)


@pytest.mark.unit
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






