"""The optional xgrammar backend (``--grammar-backend xgrammar``; ``pip install specd[xgrammar]``).

xgrammar imports torch, so this module is imported only when the backend is chosen; the default
scheduler stays torch-free. GRAMMAR.md's traps are handled here: added special tokens are blanked
in the tokenizer info (otherwise they are allowed inside JSON strings), a mask is never filled after
termination (xgrammar raises), and drafts are validated one token at a time, then rolled back,
instead of ``traverse_draft_tree`` (which writes an all-zero row at an invalid draft).

xgrammar 0.2.8 lets JSON strings hold raw control characters (invalid JSON; our tests caught it,
even with an explicit ``pattern`` in nested objects). So JSON is compiled without free whitespace
(compact output) and every JSON row is ANDed with a mask of the tokens that hold no control
character: a raw control character is then impossible anywhere in the output, as JSON requires.
Known and left alone: ``pattern`` together with ``maxLength`` drops the length bound. Grammar-forced
drafts are not offered with this backend (xgrammar forces strings, not tokens).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from scheduler_client.grammar import (
    GrammarError,
    RowMatcher,
    StructuredSpec,
    _check_choice,
    _choice_regex,
    _forbid_extra_properties,
)


def _vocab_type(tokenizer: dict[str, Any], xgr: Any) -> Any:
    decoder = json.dumps(tokenizer.get("decoder") or {})
    if "ByteLevel" in decoder:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in decoder:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


class XGrammarBackend:
    name = "xgrammar"

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        tok = json.loads(tokenizer_json)
        vocab = [""] * vocab_size
        for text, idx in tok["model"]["vocab"].items():
            if idx < vocab_size:
                vocab[idx] = text
        for added in tok.get("added_tokens", []):
            if added["id"] < vocab_size:
                # special tokens never appear inside structured text: blank them
                vocab[added["id"]] = "" if added.get("special") else added["content"]
        self.info = xgr.TokenizerInfo(
            vocab, _vocab_type(tok, xgr), vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # [words] bit set for every token without a control character (EOS stays allowed)
        from tokenizers import Tokenizer

        decoder = Tokenizer.from_str(tokenizer_json)
        clean = np.ones(vocab_size, bool)
        for i in range(vocab_size):
            text = decoder.decode([i], skip_special_tokens=False)
            clean[i] = not any(ord(c) < 0x20 for c in text)
        clean[list(eos_token_ids)] = True
        words = (vocab_size + 31) // 32
        padded = np.zeros(words * 32, bool)
        padded[:vocab_size] = clean
        self.no_control = np.packbits(padded, bitorder="little").view(np.int32)
        self.control_tokens = frozenset(np.flatnonzero(~clean).tolist())
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredSpec) -> Any:
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(spec)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses of its own
            raise GrammarError(f"invalid {spec.kind} spec: {e}") from None
        with self._lock:
            self._cache[key] = compiled
        return compiled

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self.compiler
        if spec.kind == "json":
            schema = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object")
            return c.compile_json_schema(
                json.dumps(_forbid_extra_properties(schema)),
                any_whitespace=False,
            )
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.value)
        if spec.kind == "choice":
            return c.compile_regex(_choice_regex(_check_choice(spec.value)))
        if spec.kind == "grammar":
            raise GrammarError("the xgrammar backend takes EBNF grammars (kind 'ebnf'), not Lark")
        raise GrammarError(f"unknown structured-output kind {spec.kind!r}")

    def matcher(self, spec: StructuredSpec) -> XGrammarMatcher:
        json_mode = spec.kind == "json"
        return XGrammarMatcher(
            self._xgr.GrammarMatcher(self.compile(spec)),
            self.eos_token_ids,
            self.vocab_size,
            self.no_control if json_mode else None,
            self.control_tokens if json_mode else frozenset(),
        )


class XGrammarMatcher(RowMatcher):
    def __init__(
        self,
        m: Any,
        eos: tuple[int, ...],
        vocab_size: int,
        row_filter: np.ndarray | None,
        forbidden: frozenset[int],
    ) -> None:
        super().__init__(eos, vocab_size)
        self._m = m
        self._row_filter = row_filter
        self._forbidden = forbidden

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def _consume(self, tokens: list[int]) -> int:
        done = 0
        for t in tokens:
            if self.terminated or t in self._forbidden or not self._m.accept_token(t):
                break
            done += 1
        return done

    def _rollback(self, n: int) -> None:
        self._m.rollback(n)

    def validate(self, tokens: list[int]) -> int:
        """xgrammar has no dry run: consume what it accepts, then roll back."""
        n = self._consume(tokens)
        if n:
            self._m.rollback(n)
        return n

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._row_filter is not None:
            bitmask[row] &= self._row_filter

    def _accept_one(self, token: int) -> bool:
        return token not in self._forbidden and bool(self._m.accept_token(token))
