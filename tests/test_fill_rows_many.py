"""``fill_rows_many`` (llguidance's thread pool, off the GIL) writes the rows ``fill_rows`` writes,
one matcher at a time: for every prefix of valid instances, with drafts of every length up to
and past the grammar's end (the row after EOS), terminated matchers, and many jobs in one call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from scheduler_client import grammar as grammar_mod
from scheduler_client.grammar import Matcher, StructuredSpec, fill_rows_many, make_backend
from scheduler_client.tokenizer import TokenizerInfo
from tests.models import BYTE_VOCAB, EOS_ID

WORDS = (BYTE_VOCAB + 31) // 32
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
    "required": ["a", "b"],
}
CASES = [
    (
        StructuredSpec("json", json.dumps(SCHEMA)),
        json.dumps({"a": 12, "b": "hi"}, separators=(",", ":")),
    ),
    (StructuredSpec("regex", "[a-z]{3}"), "abc"),
    (StructuredSpec("choice", ["yes", "no"]), "yes"),
]


@pytest.fixture(params=[0, 1, 2], ids=lambda n: f"threads{n}")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """--grammar-threads: 0 fills one matcher at a time, 1 and 2 use llguidance's pool."""
    before = grammar_mod.grammar_threads
    grammar_mod.set_grammar_threads(request.param)
    yield request.param
    grammar_mod.set_grammar_threads(before)


def test_many_rows_equal_one_matcher_at_a_time(target_dir: Path, threads: int) -> None:
    tok = TokenizerInfo(str(target_dir))
    grammar = make_backend("llguidance", tok.json_text, BYTE_VOCAB, (EOS_ID,))
    jobs: list[tuple[Matcher, int, list[int]]] = []
    rows = 0
    for spec, text in CASES:
        instance = [*tok.encode(text), EOS_ID]
        for pos in range(len(instance) + 1):  # the last: a matcher that has terminated
            for k in range(6):
                m = grammar.matcher(spec)
                for t in instance[:pos]:
                    assert m.accept(t)
                drafts = instance[pos : pos + k]
                drafts = drafts[: m.validate(drafts)]
                jobs.append((m, rows, drafts))
                rows += len(drafts) + 1
    assert any(m.terminated for m, _, _ in jobs)
    assert any(d and d[-1] == EOS_ID for _, _, d in jobs)
    one = np.zeros((rows, WORDS), np.int32)
    for m, start, drafts in jobs:
        m.fill_rows(one, start, drafts)
    many = np.full((rows, WORDS), 7, np.int32)
    fill_rows_many(many, jobs)
    bad = [i for i in range(rows) if not np.array_equal(one[i], many[i])]
    assert bad == [], f"rows {bad[:10]} differ"
    again = np.zeros_like(one)  # the matchers ended where they began
    fill_rows_many(again, jobs)
    assert np.array_equal(again, one)


@pytest.mark.parametrize("n", [1, 64])
def test_many_live_json_matchers_in_one_call(target_dir: Path, n: int, threads: int) -> None:
    tok = TokenizerInfo(str(target_dir))
    grammar = make_backend("llguidance", tok.json_text, BYTE_VOCAB, (EOS_ID,))
    spec, text = CASES[0]
    instance = tok.encode(text)
    jobs: list[tuple[Matcher, int, list[int]]] = []
    for i in range(n):
        m = grammar.matcher(spec)
        for t in instance[: i % len(instance)]:
            assert m.accept(t)
        jobs.append((m, i, []))
    one, many = np.zeros((n, WORDS), np.int32), np.zeros((n, WORDS), np.int32)
    for m, start, drafts in jobs:
        m.fill_rows(one, start, drafts)
    fill_rows_many(many, jobs)
    assert np.array_equal(one, many)
