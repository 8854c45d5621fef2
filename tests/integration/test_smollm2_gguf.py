"""The bundled SmolLM2-135M-Instruct GGUF: same greedy tokens as transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.model_files import default_model_path
from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.llm import LLM

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Why is the sky blue? Explain like I am five."},
    ],
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


def test_chat_prompts_match_transformers(llm, hf):
    hf_tok, hf_model = hf
    prompts = [llm.tokenizer.encode_chat(c) for c in CHATS]
    for chat, ids in zip(CHATS, prompts):  # same prompt ids as transformers' own chat template
        ref = hf_tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ids == list(ref)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    with torch.no_grad():
        for ids, got in zip(prompts, ours):
            x = torch.tensor([ids])
            ref = hf_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NUM_TOKENS,
                min_new_tokens=NUM_TOKENS,
                do_sample=False,
            )
            assert got == ref[0, len(ids) :].tolist()
    assert all(len(t) == NUM_TOKENS for t in ours)


def test_eos_stops_and_text_is_decoded(llm):
    ids = llm.tokenizer.encode_chat(CHATS[0])
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=64))[0]
    assert out.finish_reason.value == "stop"
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "Paris" in out.text and "<|im_end|>" not in out.text


def test_digits_are_split_like_smollm(llm):
    # SmolLM2's pre-tokenizer splits numbers into single digits ('smollm' in the GGUF metadata).
    ids = llm.tokenizer.encode("year 2024", add_special_tokens=False)
    assert [llm.tokenizer.decode([i]) for i in ids][-4:] == ["2", "0", "2", "4"]
