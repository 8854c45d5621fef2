"""Incremental detokenizer with stop strings.

Text is released only when it ends on a whole character (no broken multi-byte sequences), and,
while stop strings are active, the last len(longest stop) - 1 characters are held back, so the
concatenation of streamed deltas is exactly the final text.

Output tokens are decoded after a few prompt tokens of context: SentencePiece/Metaspace decoders
(Llama 2, Mistral) strip the leading space of a sequence, so the first output token decoded alone
would lose its space. Stop strings, like EOS and stop token ids, count only from min_tokens on.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer

# Prompt tokens decoded before the first output token (enough for a word boundary and a partial
# multi-byte character; vLLM uses 5 for the same reason).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        # Prompt context, then output tokens; only the output's text is kept.
        self.token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_output_tokens = 0
        self.text = ""  # decoded so far (possibly cut at a stop string)
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)
        self._sent = 0
        self._stopped = False

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Decode new tokens; returns the stop string that matched, if any."""
        if self._stopped:
            return None
        for token_id in token_ids:
            self.token_ids.append(token_id)
            self._num_output_tokens += 1
            before = len(self.text)
            self.text += self._decode_step(final=False)
            if self._num_output_tokens < self.min_tokens:
                continue
            matched = self._find_stop(before)
            if matched is not None:
                self._stopped = True
                return matched
        return None

    def resume(self, token_ids: list[int], num_chars_sent: int) -> None:
        """Continue a stream another detokenizer began: decode its tokens (none of which stopped it)
        as it did, one at a time, and count the first num_chars_sent characters as streamed."""
        self.add_tokens(token_ids)
        self._sent = min(num_chars_sent, len(self.text))

    def flush(self) -> None:
        """At the end of the request, release what waited for more bytes."""
        if not self._stopped:
            self.text += self._decode_step(final=True)

    def take_delta(self, finished: bool) -> str:
        """New text to stream; holds back a possible stop-string prefix until finished."""
        limit = len(self.text) if finished or self._stopped else max(self._sent, len(self.text) - self.hold_back)
        delta = self.text[self._sent : limit]
        self._sent = limit
        return delta

    def _decode_step(self, final: bool) -> str:
        ids = self.token_ids
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        full = self._decode(ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _find_stop(self, previous_len: int) -> str | None:
        """Earliest stop string in the text that could include new characters; cuts the text there."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return stop
