"""Text out of token ids as they arrive: an incremental detokenizer and the one stop-string search.

Both the sampling core (`StopChecker`, which ends a generation at a stop string) and the gateway (which
streams text deltas and cuts them at a stop string) use these, so stop strings mean the same everywhere.
This module knows nothing of models or services: a detokenizer is given a `decode(ids) -> str` function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for the bytes of an unfinished UTF-8 sequence


class IncrementalDetokenizer:
    """Decodes only new tokens, with the tokens of the previous text delta as context.

    vLLM's prefix / read offsets: tokens before `read_offset` are in `text`; tokens from `prefix_offset`
    to `read_offset` are decoded again with the new ones, so a decoder that depends on its neighbours
    (a leading space dropped at the start of a sequence, special tokens skipped) gives the same text as a
    decode of the whole output. A trailing U+FFFD is held back while the tokens that finish its UTF-8
    sequence may still come; the text before it is not. `text` only ever grows.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._partial = 0  # characters past the context already in `text` (written before a held-back U+FFFD)

    def add(self, ids: Sequence[int]) -> str:
        """Append tokens; return the text they add (possibly none yet)."""
        self.token_ids.extend(ids)
        if self._read_offset == len(self.token_ids):
            return ""
        prefix, window = self._window()
        complete = not window.endswith(REPLACEMENT_CHAR)
        delta = window.rstrip(REPLACEMENT_CHAR)[len(prefix) + self._partial :]
        if complete and len(window) > len(prefix):
            self._advance()
        else:
            self._partial += len(delta)
        self.text += delta
        return delta

    def tail(self) -> str:
        """The text held back so far, as a decode of the whole output would end (U+FFFD included)."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix, window = self._window()
        return window[len(prefix) + self._partial :]

    def flush(self) -> str:
        """The output is complete: add the held-back text to `text` and return it."""
        delta = self.tail()
        self.text += delta
        self._advance()
        return delta

    @property
    def window_tokens(self) -> int:
        """Tokens the next `add` decodes again besides its new ones: the last delta's, as context, and any
        held back (a run of tokens that never completes a character keeps growing it)."""
        return len(self.token_ids) - self._prefix_offset

    def _window(self) -> tuple[str, str]:
        ids = self.token_ids
        return (self._decode(ids[self._prefix_offset : self._read_offset]), self._decode(ids[self._prefix_offset :]))

    def _advance(self) -> None:
        self._prefix_offset, self._read_offset, self._partial = self._read_offset, len(self.token_ids), 0


def find_stop(text: str, stop: Sequence[str], searched: int = 0) -> int:
    """Where the earliest stop string in `text` starts, or -1.

    `searched`: how much of `text` an earlier call searched without a match. A new match must end past it,
    so the search starts at `searched - longest + 1`: each call costs the new text, not the whole output.
    """
    if not stop:
        return -1
    start = max(0, searched - max(map(len, stop)) + 1)
    return min((i for s in stop if (i := text.find(s, start)) >= 0), default=-1)
