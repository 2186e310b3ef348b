"""Structured output: a grammar (JSON schema, JSON object, regex or choice) that masks the logits.

The grammar engine is llguidance. A grammar's mask is a deterministic function of the output tokens, so it
is context-dependent processing like a penalty (`specmesh.sampling.apply_context_processing`): at every
verified position the target's logits are masked under the output so far plus the draft tokens before that
position, which makes the output law exactly the masked target's. The draft masks its own logits the same
way, so the q it sends (the q it sampled from) only proposes tokens the grammar allows.

`Grammar` holds one llguidance matcher and the tokens it has consumed. Asked for the masks of a block, it
rolls back to the longest common prefix with the output, consumes the rest and then the drafts one by one,
reading a mask before each, on a copy of the matcher: its own state stays the committed output's, whatever
was verified. Nothing depends on that bookkeeping being right except speed: a mismatch only costs a restart
and a replay of the output.

A draft token the grammar refuses (a drafter without the grammar, e.g. n-gram, or one without a tokenizer)
gets probability 0 under the masked target, so it is rejected there; the rows after it are never read, and
are left unmasked.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf as llg_hf
import torch

from specmesh.errors import InvalidArgument
from specmesh.sampling import StructuredSpec

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or list of choices larger than this is refused
MAX_CHOICES = 256
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
# JSON as Python's json.dumps writes it: no free whitespace, which a model could otherwise spend its whole
# max_tokens on before closing the value.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar of a spec; InvalidArgument naming the field when it cannot be built (a bad
    schema, an unsupported JSON-schema keyword, a malformed regex)."""
    field = spec.field_name
    if len(spec.value) > MAX_SPEC_CHARS:
        raise InvalidArgument(f"{field}: larger than {MAX_SPEC_CHARS} characters")
    if spec.kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
    elif spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except ValueError as e:
            raise InvalidArgument(f"{field}: not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{field}: a JSON schema must be an object")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
        except ValueError as e:
            raise InvalidArgument(f"{field}: {e}") from None
    elif spec.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
    elif spec.kind == "choice":
        choices = choices_of(spec)
        grammar = llguidance.LLMatcher.grammar_from_regex("|".join(_escape(c) for c in choices))
    else:
        raise InvalidArgument(f"structured output: unknown kind {spec.kind!r}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidArgument(f"{field}: unsupported or invalid: {error.strip()[:300]}")
    return grammar


def choices_of(spec: StructuredSpec) -> list[str]:
    try:
        choices = json.loads(spec.value)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgument(f"{spec.field_name}: must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidArgument(f"{spec.field_name}: at most {MAX_CHOICES} choices")
    return choices


def _escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def validate(spec: StructuredSpec | None) -> None:
    """Refuse (InvalidArgument naming the field) a spec whose grammar cannot be built."""
    if spec is not None:
        grammar_text(spec)


class GrammarCompiler:
    """A model's llguidance tokenizer (built once: about a second for a real vocabulary), making grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()):
        eos = sorted(eos_token_ids) or None
        if isinstance(tokenizer, llguidance.LLTokenizer):
            self.tokenizer = tokenizer
        elif isinstance(tokenizer, llguidance.TokenizerWrapper):
            self.tokenizer = llguidance.LLTokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        else:
            self.tokenizer = llg_hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._texts: dict[StructuredSpec, str] = {}
        self._lock = threading.Lock()

    def grammar(self, spec: StructuredSpec) -> Grammar:
        with self._lock:
            text = self._texts.get(spec)
        if text is None:
            text = grammar_text(spec)
            with self._lock:
                if len(self._texts) > 512:
                    self._texts.clear()
                self._texts[spec] = text
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"{spec.field_name}: {matcher.get_error()[:300]}")
        return Grammar(matcher, self.vocab_size)


class Grammar:
    """One generation's grammar state: llguidance's matcher, kept at the committed output between rounds."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self._fresh = matcher.deep_copy()
        self.vocab_size = vocab_size
        self._consumed: list[int] = []
        self._lock = threading.Lock()  # a session's rounds never overlap; this guards against misuse

    def _restart(self) -> None:
        # A matcher in its error state never leaves it (llguidance): start from a fresh copy.
        self.matcher = self._fresh.deep_copy()
        self._consumed.clear()

    def _sync(self, output: Sequence[int]) -> bool:
        """Bring the matcher to exactly `output`; False if the grammar refuses it."""
        done = self._consumed
        common = 0
        for a, b in zip(done, output, strict=False):
            if a != b:
                break
            common += 1
        if common < len(done):
            # A stopped matcher has consumed an EOS, which rollback does not count: start over instead.
            m = self.matcher
            if m.is_error() or m.is_stopped() or not m.rollback(len(done) - common):
                self._restart()
                common = 0
            del done[common:]
        rest = list(output[common:])
        if rest:
            if self.matcher.try_consume_tokens(rest) != len(rest) or self.matcher.is_error():
                self._restart()
                return False
            done.extend(rest)
        return not self.matcher.is_error()

    def bitmask(self, output: Sequence[int], drafts: Sequence[int], rows: int) -> torch.Tensor:
        """[rows, ceil(V / 32)] int32 bitmask: row j allows the tokens the grammar accepts after output +
        drafts[:j]. Rows after a refused draft token (never read: that token is rejected) allow everything."""
        mask = torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row_bytes = mask.size(1) * 4
        with self._lock:
            if not self._sync(output):
                # The committed output is outside the grammar (a draft-side state fed tokens it never
                # masked): nothing to constrain. The verifier never commits such a token.
                return mask
            # The drafts are walked on a copy (a few microseconds): the matcher itself stays at the committed
            # output. Rolling the drafts back instead is wrong after an EOS draft: llguidance does not count
            # a consumed EOS in what rollback undoes.
            m = self.matcher.deep_copy() if rows > 1 else self.matcher
            for j in range(rows):
                # llguidance writes the row in place (llguidance.torch does the same, but importing it compiles
                # a torch kernel: seconds at startup).
                m.unsafe_compute_mask_ptr(mask[j].data_ptr(), row_bytes)
                if j == rows - 1:
                    break
                # A draft token this row refuses is rejected by the verifier: the rows after it are never read.
                token = drafts[j]
                if not 0 <= token < self.vocab_size or not (int(mask[j, token // 32]) >> (token % 32)) & 1:
                    break
                if not m.consume_token(token):
                    break
        return mask
