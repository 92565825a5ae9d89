"""The door's stream encoding: the middle events' template gives the bytes ``json.dumps`` would,
and a reader that fell behind sends the queued tokens as one chunk, the end kept for after."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from protocol import SamplingParams
from scheduler_client import openai_api as api
from scheduler_client.engine_loop import Delta, Done, Stream
from scheduler_client.http.door import Events
from scheduler_client.request import Request


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
        done = Done(
            Request(req_id="r", prompt_ids=[1], sampling=SamplingParams(), num_speculative_tokens=0)
        )
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
