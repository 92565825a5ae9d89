"""Untrusted work off the engine thread: limits checked before the expensive work, preparation
in pools (prep.py), abort during preparation, and other streams that keep flowing meanwhile
(a real daemon with a real worker; the exact 200 ms figure is bench/prep_bench.py's)."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_client.engine_loop import Done, EngineLoop, Refused
from scheduler_client.grammar import StructuredSpec
from scheduler_client.limits import InputLimits, LimitError
from scheduler_client.prep import Preparer
from tests.daemons import wait_until
from tests.gaps import GapProbe, timed_call
from tests.procs import reap
from tests.test_scheduler_daemon import KEY, Daemon, start_daemon
from tests.test_scheduler_e2e import engine

SMALL = InputLimits(
    max_prompt_chars=100,
    max_grammar_bytes=200,
    max_schema_nodes=20,
    max_schema_depth=3,
    max_regex_chars=10,
)


def nested(depth: int) -> dict[str, object]:
    """A schema whose objects and arrays nest ``depth`` levels."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


# -- the limits on their own ----------------------------------------------------------------------
def test_each_limit_refuses_just_past_it_and_names_its_flag() -> None:
    SMALL.check_prompt("x" * 100, None)
    with pytest.raises(LimitError, match=r"101 characters.*--max-prompt-chars"):
        SMALL.check_prompt("x" * 101, None)
    with pytest.raises(LimitError, match="--max-prompt-chars"):
        SMALL.check_prompt(None, [{"role": "user", "content": "x" * 60}] * 2)
    SMALL.check_prompt(list(range(10_000)), None)  # token ids: max_model_len decides
    SMALL.check_spec(StructuredSpec("regex", "a" * 10))
    with pytest.raises(LimitError, match="--max-regex-chars"):
        SMALL.check_spec(StructuredSpec("regex", "a" * 11))
    SMALL.check_spec(StructuredSpec("json", {"enum": list(range(18))}))  # 20 values
    with pytest.raises(LimitError, match="--max-schema-nodes"):
        SMALL.check_spec(StructuredSpec("json", {"enum": list(range(19))}))
    with pytest.raises(LimitError, match="--max-schema-nodes"):
        SMALL.check_spec(StructuredSpec("choice", [str(i) for i in range(21)]))
    SMALL.check_spec(StructuredSpec("json", nested(3)))
    with pytest.raises(LimitError, match="--max-schema-depth"):
        SMALL.check_spec(StructuredSpec("json", nested(4)))
    with pytest.raises(LimitError, match="--max-grammar-bytes"):
        SMALL.check_spec(StructuredSpec("json", {"description": "x" * 300}))
    with pytest.raises(LimitError, match="--max-grammar-bytes"):
        SMALL.check_spec(StructuredSpec("grammar", 'start: "' + "a" * 300 + '"'))
    with pytest.raises(LimitError, match="--max-schema-depth"):  # schema given as JSON text
        SMALL.check_spec(StructuredSpec("json", json.dumps(nested(4))))


def test_the_schema_walk_stops_at_the_limit() -> None:
    # 10**6 alternatives and 10**5 levels: refused by the first value or level past the limit,
    # without recursion
    wide = {"anyOf": [{"type": "integer"}] * 1_000_000}
    deep: object = {}
    for _ in range(100_000):
        deep = {"items": deep}
    t0 = time.perf_counter()
    with pytest.raises(LimitError, match="--max-schema-nodes"):
        InputLimits().check_spec(StructuredSpec("json", wide))
    with pytest.raises(LimitError, match="--max-schema-depth"):
        InputLimits().check_spec(StructuredSpec("json", deep))
    assert time.perf_counter() - t0 < 10  # typically 0.05 s; a walk of everything takes longer


def test_bad_limits_fail_at_start_up() -> None:
    with pytest.raises(ValueError, match="--max-schema-depth must be >= 1"):
        InputLimits(max_schema_depth=0)


# -- abort and errors during preparation (a real engine and worker) ------------------------------
@pytest.fixture(scope="module")
def loop(target_dir: Path) -> Iterator[EngineLoop]:
    eng = engine(target_dir, "none")
    assert eng.tokenizer is not None
    prep = Preparer(
        tokenizer_dir=eng.tokenizer.directory,
        grammar=eng.scheduler.grammar,
        limits=InputLimits(max_prompt_chars=50_000_000, max_schema_nodes=100_000),
        max_model_len=eng.ready.max_model_len,
        num_threads=2,
        num_processes=2,
    )
    lp = EngineLoop(eng, prep)
    thread = threading.Thread(target=lp.run, name="engine")
    thread.start()
    try:
        yield lp
    finally:
        lp.drain(0)
        thread.join(timeout=120)
        prep.close()
        eng.close()
        assert not thread.is_alive()


def test_abort_during_preparation_ends_the_request_and_the_engine_goes_on(
    loop: EngineLoop,
) -> None:
    big = loop.submit({"prompt": "hello world " * 500_000, "max_tokens": 4})  # 6 MB
    wait_until(lambda: loop.num_active == 1, 30, "the request counted as active while prepared")
    t0 = time.monotonic()
    big.abort()
    event = big.get(timeout_s=60)
    assert isinstance(event, Refused) and "aborted" in event.message, event
    # long before tokenizing 6 MB could end (seconds here): the abort did not wait for it
    assert time.monotonic() - t0 < 5
    ok = loop.submit({"prompt": "abc", "max_tokens": 4, "ignore_eos": True})
    events = []
    while not events or not isinstance(events[-1], Done | Refused):
        events.append(ok.get(timeout_s=120))
    done = events[-1]
    assert isinstance(done, Done) and len(done.result.output_ids) == 4, done
    with pytest.raises(queue.Empty):  # the aborted request says nothing more
        big.get(timeout_s=0.1)


def test_preparation_errors_refuse_only_that_request(loop: EngineLoop) -> None:
    bad = loop.submit({"prompt": "abc", "structured": {"regex": "(unclosed"}})
    long = loop.submit({"prompt": "x" * 5000, "max_tokens": 4})  # 5000 byte tokens > 384
    ok = loop.submit({"prompt": "abc", "max_tokens": 3, "ignore_eos": True})
    event = bad.get(timeout_s=120)
    assert isinstance(event, Refused) and "regex" in event.message, event
    event = long.get(timeout_s=120)
    assert isinstance(event, Refused) and "5000 tokens is too long" in event.message, event
    last = ok.get(timeout_s=120)
    while not isinstance(last, Done | Refused):
        last = ok.get(timeout_s=120)
    assert isinstance(last, Done) and len(last.result.output_ids) == 3


def test_a_request_is_prepared_while_the_engine_thread_is_busy(loop: EngineLoop) -> None:
    """The engine's thread takes its inbox only between steps. A request's preparation starts as
    it is submitted: held up on that thread (as by a step), the request is prepared meanwhile,
    and its "prepared" event waits in the inbox behind its "add". Before, its preparation began
    only once the thread was free, and it joined the scheduler a step later."""
    armed, held, release = threading.Event(), threading.Event(), threading.Event()

    def hold_up() -> None:
        if armed.is_set():
            armed.clear()
            held.set()
            release.wait(60)

    loop.after_step = hold_up
    try:
        armed.set()
        assert held.wait(30), "the engine's thread did not come round"
        stream = loop.submit({"prompt": "abc", "max_tokens": 2, "ignore_eos": True})
        wait_until(lambda: loop._inbox.qsize() >= 2, 30, "its preparation ended meanwhile")
    finally:
        release.set()
        loop.after_step = None
    last = stream.get(timeout_s=120)
    while not isinstance(last, Done | Refused):
        last = stream.get(timeout_s=120)
    assert isinstance(last, Done) and len(last.result.output_ids) == 2, last


# -- through a running daemon --------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Iterator[Daemon]:
    d = start_daemon(
        tmp_path_factory.mktemp("sched"),
        target_dir,
        "--max-prompt-chars",
        "4000000",
        "--max-schema-nodes",
        "50",
        "--max-schema-depth",
        "6",
        "--max-regex-chars",
        "20",
        "--max-grammar-bytes",
        "2000",
    )
    try:
        yield d
    finally:
        reap(d.proc)


def test_over_limit_requests_get_400_naming_the_limit(daemon: Daemon) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ({"prompt": "x" * 4_000_001}, "/v1/completions", "--max-prompt-chars"),
        ({**chat, "guided_choice": [str(i) for i in range(60)]}, None, "--max-schema-nodes"),
        ({**chat, "guided_json": nested(7)}, None, "--max-schema-depth"),
        ({**chat, "guided_regex": "[a-z]" * 5}, None, "--max-regex-chars"),
        ({**chat, "guided_grammar": 'start: "' + "a" * 3000 + '"'}, None, "--max-grammar-bytes"),
    ]
    for body, path, flag in cases:
        status, answer = daemon.call(path or "/v1/chat/completions", body)
        assert status == 400 and flag in answer["error"]["message"], (flag, status, answer)
    status, answer = daemon.call("/v1/chat/completions", {**chat, "guided_regex": "[a-z]{3}"})
    assert status == 200 and len(answer["choices"][0]["message"]["content"]) == 3, answer


def test_a_huge_prompt_is_tokenized_while_other_streams_flow(daemon: Daemon) -> None:
    data = json.dumps({"prompt": "hello world " * 300_000, "max_tokens": 4}).encode()  # 3.6 MB
    with GapProbe(daemon.port, KEY) as probe:
        status, answer, t0, t1 = timed_call(daemon.port, KEY, "/v1/completions", data)
    assert status == 400 and "3600000 tokens is too long" in answer["error"]["message"], answer
    gap, meanwhile = probe.largest_gap(t0, t1), probe.num_events(t0, t1)
    print(f"tokenized in {t1 - t0:.2f} s; largest gap {gap * 1e3:.0f} ms; {meanwhile} tokens")
    # On the engine thread the probe would wait the whole tokenization (8.9 s for 4 MB in the
    # issue) and stream nothing meanwhile. The 200 ms figure is measured by bench/prep_bench.py;
    # here a bound that a loaded 2-core machine keeps.
    assert meanwhile >= 10 and gap < (t1 - t0) / 2, (gap, meanwhile, t1 - t0)


def test_a_grammar_too_complex_for_llguidance_fails_naming_why(loop: EngineLoop) -> None:
    # compiled off the engine thread; llguidance then refuses the first token (more than 2000
    # items in a parser row): the request fails with llguidance's reason, not a bare "rejected"
    schema = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
            for i in range(2100)
        ]
    }
    s = loop.submit({"prompt": "abc", "max_tokens": 8, "structured": {"json": schema}})
    event = s.get(timeout_s=120)
    while not isinstance(event, Done | Refused):
        event = s.get(timeout_s=120)
    assert isinstance(event, Done) and event.result.finish_reason == "error", event
    assert "max is 2000" in (event.result.error or ""), event.result.error
