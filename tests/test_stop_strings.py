"""Stop strings: nothing past (or inside) a stop string is ever streamed, the final text ends
before it, streamed and non-streamed text agree, and usage counts the tokens up to the one that
completed the stop. The hold-back alone (hypothesis), then a real engine and a real daemon."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_client import Engine
from scheduler_client.stop_strings import StopStrings
from scheduler_client.tokenizer import TokenizerInfo
from tests.procs import reap
from tests.test_scheduler_daemon import Daemon, start_daemon
from tests.test_scheduler_e2e import engine

# -- the hold-back on its own --------------------------------------------------------------------
text_st = st.text(alphabet="ab\n:", max_size=40)
stops_st = st.lists(st.text(alphabet="ab\n:", min_size=1, max_size=4), min_size=1, max_size=3)


@given(text=text_st, stops=stops_st, cuts=st.lists(st.integers(0, 40), max_size=12))
@settings(max_examples=400, deadline=None)
def test_released_text_is_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[i:j] for i, j in itertools.pairwise(bounds)]
    # Generation ends with the first delta that completes a stop (nothing after it is ever
    # produced): the answer ends before the earliest-starting stop in the text up to that delta.
    # (Text "::\n:" in deltas "::\n", ":" with stops "\n" and ":\n:" ends "::": ":\n:" would
    # start earlier, but "\n" completes first.)
    hits: list[int] = []
    for end in bounds[1:]:
        hits = [text[:end].find(s) for s in stops if s in text[:end]]
        if hits:
            break
    want = text[: min(hits)] if hits else text
    ss = StopStrings(tuple(stops))
    out = ""
    for d in deltas:
        out += ss.add(d)
        # never released: a stop, or text the final answer does not start with
        assert want.startswith(out), (out, want)
        if ss.stopped:
            break
    if not ss.stopped:
        out += ss.flush()
    assert out == want and ss.stopped == bool(hits)
    assert ss.text == want


def test_a_possible_stop_is_held_until_the_next_delta_settles_it() -> None:
    ss = StopStrings(("\n\n", "Observation:"))
    assert ss.add("x = 1\n") == "x = 1"  # "\n" may begin "\n\n"
    assert ss.add("y") == "\ny"  # it did not
    assert ss.add(" Obs") == " "
    assert ss.add("erv") == ""
    assert ss.add("ation: 3") == "" and ss.stopped and ss.text == "x = 1\ny "
    ss = StopStrings(("END",))
    assert ss.add("abc E") == "abc " and ss.flush() == "E"  # the request ended otherwise


# -- a real engine (worker process, tiny byte-level model) -------------------------------------
@pytest.fixture(scope="module", params=["none", "ngram"])
def eng(request: pytest.FixtureRequest, target_dir: Path) -> Iterator[Engine]:
    e = engine(target_dir, request.param)
    yield e
    e.close()


def first_completing(tok: TokenizerInfo, ids: list[int], stop: str) -> int:
    """How many tokens it takes for the decoded text to hold ``stop``."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


def spanning_stops(text: str) -> list[str]:
    """ASCII stop strings of 3 characters (so 3 byte tokens) first seen past the start."""
    out = []
    for i in range(3, len(text) - 3):
        s = text[i : i + 3]
        if s.isascii() and text.find(s) == i and s not in out:
            out.append(s)
    return out


def test_stop_strings_end_text_stream_and_usage_at_the_stop(eng: Engine) -> None:
    args = {"prompt": "The quick brown fox", "max_tokens": 40, "ignore_eos": True}
    (free,) = eng.generate([args])
    assert eng.tokenizer is not None
    stops = spanning_stops(free.text)
    assert len(stops) >= 3, free.text
    for stop in stops[:4]:
        (cut,) = eng.generate([{**args, "stop": [stop]}])
        want = free.text[: free.text.find(stop)]
        assert cut.finish_reason == "stop" and cut.text == want, (stop, cut.text, want)
        # usage: the tokens up to and including the one that completed the stop, even when a
        # speculative step committed more after it
        n = first_completing(eng.tokenizer, free.output_ids, stop)
        assert cut.output_ids == free.output_ids[:n], (stop, len(cut.output_ids), n)
        pieces = list(eng.stream(**args, stop=[stop]))
        assert "".join(pieces) == want, (stop, pieces)
        assert all(stop not in p for p in pieces)


def test_a_stop_that_never_completes_releases_the_held_text(eng: Engine) -> None:
    args = {"prompt": "The quick brown fox", "max_tokens": 40, "ignore_eos": True}
    (free,) = eng.generate([args])
    # the text's last character begins this stop, which never completes: held, then flushed
    stop = free.text[-1] + "\x00never"
    (cut,) = eng.generate([{**args, "stop": [stop]}])
    assert (cut.finish_reason, cut.text, cut.output_ids) == ("length", free.text, free.output_ids)
    assert "".join(eng.stream(**args, stop=[stop])) == free.text


# -- a real daemon --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("sched"), target_dir)
    try:
        yield d
    finally:
        reap(d.proc)


def test_streamed_and_plain_answers_agree_on_text_and_usage(daemon: Daemon) -> None:
    body = {"prompt": "The quick brown fox", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    status, free = daemon.call("/v1/completions", body)
    assert status == 200, free
    text = free["choices"][0]["text"]
    for stop in spanning_stops(text)[:3]:
        status, plain = daemon.call("/v1/completions", {**body, "stop": stop})
        assert status == 200, plain
        choice = plain["choices"][0]
        assert choice["text"] == text[: text.find(stop)] and choice["finish_reason"] == "stop"
        events = daemon.events(
            "/v1/completions", {**body, "stop": [stop], "stream_options": {"include_usage": True}}
        )
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert streamed == choice["text"], (stop, streamed)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["usage"] == plain["usage"]
        # fewer tokens than the free run (the exact count is checked on the engine, above)
        assert plain["usage"]["completion_tokens"] < free["usage"]["completion_tokens"]
