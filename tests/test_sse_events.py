"""The door's stream encoding: the middle events' template gives the bytes ``json.dumps`` would,
a reader that fell behind sends the queued tokens as one chunk, the end kept for after, and
``--stream-interval N`` puts the first token at once, then every N (a real engine and worker)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler_client import openai_api as api
from scheduler_client.engine import Engine
from scheduler_client.engine_loop import Delta, Done, EngineLoop, Finished, Refused, Stream
from scheduler_client.http.door import Events


@pytest.mark.parametrize("chat", [True, False])
def test_text_chunks_are_the_bytes_of_json_dumps(chat: bool) -> None:
    req_id, model = 'cmpl-\u00e9"1', 'org/m"odel\\x'
    encode = api.text_chunks(req_id, chat=chat, model=model, created=17)
    for text in ["a", "", 'h\u00e9llo "q" \\ \n\t', "\u2603\U0001f600", "\x00text\x00"]:
        obj = api.chunk(req_id, chat=chat, model=model, created=17, text=text)
        assert encode(text) == b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def test_a_reader_behind_the_engine_reads_queued_deltas_as_one() -> None:
    async def read() -> list[Any]:
        door: Any = SimpleNamespace(wakeups=None, alive=True)
        events = Events(door)
        events.stream = Stream(loop=None)  # type: ignore[arg-type]
        done = Done(Finished("r", "stop", None, "abc", 1, [5, 6, 7], {}))
        for e in [Delta("a"), Delta("b"), Delta("c"), done]:
            events.stream.events.put(e)
        first = await events.next()
        assert first == Delta("a")
        merged = events.more_text()
        again = events.more_text()  # the end is held: nothing is read past it
        return [merged, again, await events.next()]

    merged, again, held = asyncio.run(read())
    assert merged == "bc"
    assert again == ""
    assert isinstance(held, Done)  # kept for next(), not lost behind the merge


@pytest.fixture(scope="module")
def engine_none(target_dir: Path) -> Iterator[Engine]:
    from tests.test_scheduler_e2e import engine

    eng = engine(target_dir, "none")  # one token a step
    try:
        yield eng
    finally:
        eng.close()


def stream_once(eng: Engine, interval: int, max_tokens: int) -> tuple[list[str], Done]:
    loop = EngineLoop(eng, stream_interval=interval)
    thread = threading.Thread(target=loop.run, name="engine")
    thread.start()
    try:
        s = loop.submit({"prompt": "the cat", "max_tokens": max_tokens, "ignore_eos": True})
        texts: list[str] = []
        while True:
            event = s.get(timeout_s=120)
            if isinstance(event, Delta):
                texts.append(event.text)
            else:
                assert isinstance(event, Done), event
                return texts, event
    finally:
        loop.drain(0)
        thread.join(timeout=120)
        assert not thread.is_alive()


def test_stream_interval_puts_the_first_token_then_every_n(engine_none: Engine) -> None:
    each, done1 = stream_once(engine_none, 1, 13)
    assert len(each) == 13  # a Delta a token
    by4, done4 = stream_once(engine_none, 4, 13)
    assert done4.result.output_ids == done1.result.output_ids
    assert "".join(by4) == "".join(each)
    # tokens 1 | 2-5 | 6-9 | 10-13: the first at once, then every 4
    assert by4 == [each[0], "".join(each[1:5]), "".join(each[5:9]), "".join(each[9:13])]
    by5, _ = stream_once(engine_none, 5, 13)  # 1 | 2-6 | 7-11 | 12-13 held to the end
    assert by5 == [each[0], "".join(each[1:6]), "".join(each[6:11]), "".join(each[11:13])]


def test_a_stream_interval_below_1_is_refused(engine_none: Engine) -> None:
    with pytest.raises(ValueError, match="--stream-interval must be >= 1"):
        EngineLoop(engine_none, stream_interval=0)


def test_a_request_submitted_after_the_loop_ended_is_refused_503(engine_none: Engine) -> None:
    """A loop whose run has returned (drained, or its worker lost) answers at once: nobody reads
    its inbox any more (data parallel: the other loops go on serving)."""
    loop = EngineLoop(engine_none)
    loop.drain(0.0)
    loop.run()  # nothing to run: returns at once
    stream = loop.submit({"prompt": [1, 2, 3], "max_tokens": 2})
    event = stream.get(timeout_s=5)
    assert isinstance(event, Refused) and event.status == 503, event
