"""The serving benchmark's steady-window throughput (bench/serve_load.py)."""

from __future__ import annotations

import pytest

from bench.serve_load import Result, steady_tok_s


def test_steady_throughput_leaves_out_the_drain_after_the_last_request_sent() -> None:
    # two clients: one sends at 0 and at 10, the other at 0; each request makes 100 tokens
    # evenly from its first token (1 s after it was sent) to its end (11 s after it)
    results = [
        Result(1.0, 11.0, 100, None, 0.0),
        Result(1.0, 11.0, 100, None, 0.0),
        Result(1.0, 11.0, 100, None, 10.0),
    ]
    # window 0..10: each of the first two made 90 of its tokens (1..10), the third none yet
    assert steady_tok_s(results) == pytest.approx(180 / 10)


def test_steady_throughput_counts_a_one_event_answer_at_its_end_and_skips_errors() -> None:
    results = [
        Result(2.0, 2.0, 5, None, 0.0),  # every token in one event, at 2 s
        Result(None, 1.0, 0, "HTTP 500", 1.0),
        Result(1.0, 9.0, 80, None, 4.0),  # tokens 5..13, window 0..4: none of them
    ]
    assert steady_tok_s(results) == pytest.approx(5 / 4)


def test_no_window_no_figure() -> None:
    assert steady_tok_s([Result(1.0, 2.0, 10, None, 3.0)]) is None
    assert steady_tok_s([Result(1.0, 2.0, 10, None, 3.0), Result(1.0, 2.0, 10, None, 3.0)]) is None
