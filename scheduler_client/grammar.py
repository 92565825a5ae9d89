"""Structured outputs: compile a request's spec once, then validate drafts, fill bitmask rows,
accept committed tokens and roll back, behind one small interface.

llguidance is the default backend (no torch; strictest in our negative tests). The pitfalls in
GRAMMAR.md shape this module: drafts are validated before anything is consumed (consuming an invalid
token leaves llguidance in an error state that rollback does not clear); the matcher is never fed or
asked for a mask after it has stopped (we track termination ourselves and fill EOS-only rows); an
EOS consumed after the grammar stopped is never counted for rollback.

Choices a user should know (docs/architecture.md repeats them): JSON objects forbid properties the
schema does not name unless the schema says ``additionalProperties`` itself; JSON whitespace
between tokens is bounded to ``MAX_JSON_WHITESPACE`` characters so a model cannot loop on spaces.
"""

from __future__ import annotations

import json
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

MAX_JSON_WHITESPACE = 2
SpecKind = Literal["json", "regex", "grammar", "ebnf", "choice"]


class GrammarError(ValueError):
    """The request's structured-output spec is invalid; the message says what is wrong."""


@dataclass(frozen=True)
class StructuredSpec:
    """What the output must match. ``value``: a JSON schema (dict or JSON text) for "json", a regex
    for "regex", a Lark grammar for "grammar", a GBNF/EBNF grammar for "ebnf", a list of strings
    for "choice"."""

    kind: SpecKind
    value: Any

    def key(self) -> str:
        return f"{self.kind}:{json.dumps(self.value, sort_keys=True)}"


def parse_spec(structured: StructuredSpec | dict[str, Any] | None) -> StructuredSpec | None:
    """A request's ``structured`` argument: a ``StructuredSpec`` or ``{"json": schema}``,
    ``{"regex": ...}``, ``{"grammar": lark}``, ``{"ebnf": gbnf}``, ``{"choice": [...]}``."""
    if structured is None or isinstance(structured, StructuredSpec):
        return structured
    if not isinstance(structured, dict) or len(structured) != 1:
        raise ValueError(
            'structured must have one key: "json", "regex", "grammar", "ebnf" or "choice"'
        )
    ((kind, value),) = structured.items()
    kinds: dict[str, SpecKind] = {
        "json": "json",
        "ebnf": "ebnf",
        "regex": "regex",
        "grammar": "grammar",
        "choice": "choice",
    }
    if kind in kinds:
        return StructuredSpec(kinds[kind], value)
    raise ValueError(f"unknown structured-output kind {kind!r}")


class Matcher(Protocol):
    """One request's grammar state. Only the scheduler's step thread calls it."""

    def validate(self, tokens: list[int]) -> int: ...
    def fill_rows(self, bitmask: np.ndarray, start_row: int, drafts: list[int]) -> None: ...
    def accept(self, token: int) -> bool: ...
    def forced_tokens(self, drafts: list[int], limit: int) -> list[int]: ...
    @property
    def terminated(self) -> bool: ...
    @property
    def error(self) -> str: ...


def _forbid_extra_properties(schema: Any) -> Any:
    """Objects allow only the properties they name, unless they say otherwise."""
    if isinstance(schema, dict):
        out = {k: _forbid_extra_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_forbid_extra_properties(v) for v in schema]
    return schema


def _regex_escape_choice(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in text)


def _choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(_regex_escape_choice(c) for c in choices) + ")"


def _check_choice(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise GrammarError("a choice spec must be a non-empty list of non-empty strings")
    return value


class LLGuidanceBackend:
    """Compiles specs to llguidance grammars (cached by spec) and makes matchers."""

    name = "llguidance"

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        if not eos_token_ids:
            raise ValueError("structured outputs need the model's EOS token id")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile(self, spec: StructuredSpec) -> str:
        """The grammar for ``spec``; raises ``GrammarError`` naming the problem. Cached."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        grammar = self._grammar(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise GrammarError(f"invalid {spec.kind} spec: {messages[0] if messages else '?'}")
        with self._lock:
            self._cache[key] = grammar
            self.num_compiles += 1
        return grammar

    def _grammar(self, spec: StructuredSpec) -> str:
        try:
            if spec.kind == "json":
                schema = spec.value
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON schema must be an object")
                return str(
                    llguidance.LLMatcher.grammar_from_json_schema(
                        _forbid_extra_properties(schema),
                        defaults={
                            "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"
                        },
                    )
                )
            if spec.kind == "regex":
                if not isinstance(spec.value, str):
                    raise GrammarError("a regex spec must be a string")
                return str(llguidance.LLMatcher.grammar_from_regex(spec.value))
            if spec.kind == "grammar":
                if not isinstance(spec.value, str):
                    raise GrammarError("a grammar spec must be Lark text")
                return str(llguidance.LLMatcher.grammar_from_lark(spec.value))
            if spec.kind == "ebnf":
                if not isinstance(spec.value, str):
                    raise GrammarError("an ebnf spec must be GBNF text")
                lark = gbnf_to_lark(spec.value)
                return str(llguidance.LLMatcher.grammar_from_lark(lark))
            if spec.kind == "choice":
                regex = _choice_regex(_check_choice(spec.value))
                return str(llguidance.LLMatcher.grammar_from_regex(regex))
        except (ValueError, TypeError) as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"invalid {spec.kind} spec: {e}") from None
        raise GrammarError(f"unknown structured-output kind {spec.kind!r}")

    def matcher(self, spec: StructuredSpec) -> LLGuidanceMatcher:
        m = llguidance.LLMatcher(self.tokenizer, self.compile(spec), log_level=0)
        if m.is_error():
            raise GrammarError(f"invalid {spec.kind} spec: {m.get_error()}")
        return LLGuidanceMatcher(m, self.eos_token_ids, self.vocab_size)


def token_row(tokens: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """A bitmask row [ceil(V/32)] that allows exactly ``tokens``."""
    row = np.zeros((vocab_size + 31) // 32, np.int32)
    for t in tokens:
        row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return row


class RowMatcher(ABC):
    """What every backend's matcher shares: the row-filling walk over drafts (state after each,
    then a rollback), EOS-only rows once the grammar has stopped, and the commit check. A backend
    supplies the engine calls."""

    def __init__(self, eos: tuple[int, ...], vocab_size: int) -> None:
        self._eos = eos
        self._eos_row = token_row(eos, vocab_size)

    @property
    @abstractmethod
    def terminated(self) -> bool: ...

    @property
    def error(self) -> str:
        return ""

    @abstractmethod
    def _consume(self, tokens: list[int]) -> int:
        """Consume valid tokens, never past termination; returns how many rollback must undo."""

    @abstractmethod
    def _rollback(self, n: int) -> None: ...

    @abstractmethod
    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        """The live state's mask into ``bitmask[row]`` (never called after termination)."""

    @abstractmethod
    def _accept_one(self, token: int) -> bool: ...

    def fill_rows(self, bitmask: np.ndarray, start_row: int, drafts: list[int]) -> None:
        """Rows start_row .. start_row + len(drafts): row i is the state after drafts[:i]. The
        drafts must have passed ``validate``. The matcher ends where it began."""
        consumed = 0
        try:
            for i in range(len(drafts) + 1):
                if self.terminated:
                    bitmask[start_row + i] = self._eos_row
                else:
                    self._fill(bitmask, start_row + i)
                if i < len(drafts):
                    consumed += self._consume([drafts[i]])
        finally:
            if consumed:
                self._rollback(consumed)

    def forced_tokens(self, drafts: list[int], limit: int) -> list[int]:
        return []

    def accept(self, token: int) -> bool:
        """Commit a sampled token. False: the grammar rejects it (the request must end)."""
        if self.terminated:
            return token in self._eos
        return self._accept_one(token)


class LLGuidanceMatcher(RowMatcher):
    def __init__(self, m: llguidance.LLMatcher, eos: tuple[int, ...], vocab_size: int) -> None:
        super().__init__(eos, vocab_size)
        self._m = m

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error()) if self._m.is_error() else ""

    def validate(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar accepts, without consuming any. Nothing after a
        token that ends the grammar counts (the request ends there)."""
        if self.terminated or not tokens:
            return 0
        n = int(self._m.validate_tokens(tokens))
        for i, t in enumerate(tokens[:n]):
            if t in self._eos:
                return i + 1
        return n

    def _consume(self, tokens: list[int]) -> int:
        done = 0
        for t in tokens:
            if self.terminated:
                break  # an EOS after the stop is not recorded: never count it
            if not self._m.consume_token(t):
                raise AssertionError(f"validated token {t} was rejected: {self._m.get_error()}")
            done += 1
        return done

    def _rollback(self, n: int) -> None:
        self._m.rollback(n)

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(self._m, bitmask, row)

    def _accept_one(self, token: int) -> bool:
        # validate first: consuming an invalid token leaves llguidance in an error state
        return bool(self._m.validate_tokens([token])) and bool(self._m.consume_token(token))

    def forced_tokens(self, drafts: list[int], limit: int) -> list[int]:
        """Tokens the grammar forces after ``drafts`` (validated), at most ``limit``."""
        if limit <= 0:
            return []
        consumed = self._consume(drafts)
        try:
            if self.terminated:
                return []
            return [int(t) for t in self._m.compute_ff_tokens()[:limit]]
        finally:
            if consumed:
                self._m.rollback(consumed)


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()
# threads of llguidance's pool for a step's masks; 0: one matcher at a time on the caller's thread
grammar_threads = max(1, min(4, (os.cpu_count() or 1) // 4))


def set_grammar_threads(n: int) -> None:
    """``specd-scheduler --grammar-threads``: before the first step."""
    global grammar_threads, _executor
    if n < 0:
        raise ValueError("--grammar-threads must be >= 0")
    with _executor_lock:
        grammar_threads, _executor = n, None


def _llg_executor() -> llguidance.LLExecutor:
    """llguidance's thread pool, made on first use."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor(grammar_threads)
        return _executor


def fill_rows_many(bitmask: np.ndarray, jobs: list[tuple[Matcher, int, list[int]]]) -> None:
    """``matcher.fill_rows(bitmask, start_row, drafts)`` for each job, the same rows. The live
    llguidance matchers' masks are computed in two calls to llguidance's thread pool
    (``grammar_threads``), each releasing the GIL once: one at a time, every row released and
    retook it, and beside the busy HTTP thread each retake waited up to the switch interval.
    Other matchers fill one by one. ``bitmask`` is one C-ordered int32 array [rows, words];
    the drafts must have passed ``validate``."""
    pooled: list[tuple[LLGuidanceMatcher, int, list[int]]] = []
    for matcher, start, drafts in jobs:
        if grammar_threads and isinstance(matcher, LLGuidanceMatcher) and not matcher.terminated:
            pooled.append((matcher, start, drafts))
        else:
            matcher.fill_rows(bitmask, start, drafts)
    plain = [(m._m, start) for m, start, drafts in pooled if not drafts]
    drafted = [(m._m, start, drafts) for m, start, drafts in pooled if drafts]
    if plain:
        llguidance.numpy.fill_next_token_bitmask_par(_llg_executor(), plain, bitmask)
    if drafted:
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(
            _llg_executor(), drafted, bitmask
        )
    for m, start, drafts in pooled:
        # a valid draft that ends the grammar is its last (``validate``): the row after it
        # allows EOS only, as ``fill_rows`` writes it (llguidance's stopped mask differs)
        if drafts and drafts[-1] in m._eos:
            bitmask[start + len(drafts)] = m._eos_row
        if m._m.is_error():  # a limit hit in the pool: fill_rows names it (never a stale row)
            m.fill_rows(bitmask, start, drafts)


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredSpec) -> Any: ...
    def matcher(self, spec: StructuredSpec) -> Matcher: ...


def make_backend(
    name: str, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarBackend:
    if name == "llguidance":
        return LLGuidanceBackend(tokenizer_json, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from scheduler_client.grammar_xgrammar import XGrammarBackend

        return XGrammarBackend(tokenizer_json, vocab_size, eos_token_ids)
    raise ValueError(f"unknown grammar backend {name!r}: use llguidance or xgrammar")
