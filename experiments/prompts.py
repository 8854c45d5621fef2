"""Text prompts of a requested token length, for OpenAI chat endpoints (which take no token ids).

The workload's prompts are token ids (exact lengths, shared prefixes). A chat message is text, so each
prompt becomes text of about its length:

  with the server's POST /tokenize and /detokenize (vLLM's shapes; splitserve's gateway has them):
      the prompt's ids are detokenized and the chat (one user message of that text) tokenized,
      shortening or lengthening the id list until the chat is as many tokens as the prompt (the
      template's own tokens included; random ids seldom survive a round trip token for token, so it
      takes a few tries, and may stay a token or two off);
  without them: one common English word per token id, picked by the id. Most BPE vocabularies hold
      each of these words as one token with its leading space, so lengths are close, not exact.

Either way equal ids give equal text, so shared prefixes stay shared. The server's usage chunk reports
the real prompt length, which the load generator records in place of the requested one.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import httpx

from splitserve.experiments.workload import RequestSpec

PromptKey = tuple[int, ...]  # a prompt's token ids
_MAX_FITS = 5  # detokenize/tokenize rounds per prompt
_PREPARE_CONCURRENCY = 16  # /tokenize calls in flight while preparing

WORDS = (
    "the time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name team minute idea kid body information back parent face level office door "
    "health person art war history party result change morning reason research girl guy moment air "
    "teacher force education food music market road river tree field paper table window street wall"
).split()


def word_prompt(ids: Sequence[int]) -> str:
    """One word per token id, chosen by the id."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


async def chat_prompts(http: httpx.AsyncClient, model: str, specs: Sequence[RequestSpec]) -> dict[PromptKey, str]:
    """The text of every distinct prompt of specs (see the module docstring for how)."""
    keys = list(dict.fromkeys(tuple(s.prompt_token_ids) for s in specs))
    overhead = await _template_tokens(http, model)
    if overhead is None:
        return {key: word_prompt(key) for key in keys}
    gate = asyncio.Semaphore(_PREPARE_CONCURRENCY)

    async def fitted(key: PromptKey) -> str:
        async with gate:
            return await _fitted_text(http, model, key, overhead)

    return dict(zip(keys, await asyncio.gather(*(fitted(k) for k in keys))))


async def _template_tokens(http: httpx.AsyncClient, model: str) -> int | None:
    """Tokens the chat template adds around one user message; None when the server cannot tell us."""
    response = await http.post("/tokenize", json={"model": model, "messages": _user("")})
    if response.status_code != 200:
        print(
            f"[bench] POST /tokenize answered HTTP {response.status_code}: chat prompts are one word per "
            "token id, so their lengths are approximate (the server's usage reports the real ones)",
            file=sys.stderr,
        )
        return None
    return int(response.json()["count"])


async def _fitted_text(http: httpx.AsyncClient, model: str, ids: PromptKey, overhead: int) -> str:
    """A user message whose templated prompt is len(ids) tokens, or the closest of a few tries: the
    detokenized first k ids (cycled), k scaled by the content tokens each id turned out to make."""
    target, want = len(ids), max(1, len(ids) - overhead)
    k, best = want, (len(ids), "")
    for _ in range(_MAX_FITS):
        text = await _detokenize(http, model, [ids[i % len(ids)] for i in range(k)])
        count = await _chat_tokens(http, model, text)
        best = min(best, (abs(count - target), text))
        if count == target:
            break
        scaled = max(1, round(k * want / max(1, count - overhead)))
        k = scaled if scaled != k else max(1, k + (1 if count < target else -1))
    return best[1]


async def _detokenize(http: httpx.AsyncClient, model: str, ids: list[int]) -> str:
    response = await http.post("/detokenize", json={"model": model, "tokens": ids})
    response.raise_for_status()
    return str(response.json()["prompt"])


async def _chat_tokens(http: httpx.AsyncClient, model: str, text: str) -> int:
    response = await http.post("/tokenize", json={"model": model, "messages": _user(text)})
    response.raise_for_status()
    return int(response.json()["count"])


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
