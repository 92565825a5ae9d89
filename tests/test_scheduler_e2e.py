"""Scheduler and worker as two real processes over ipc:// (CPU, tiny byte-level models)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from scheduler_client import Engine, EngineConfig, SchedulerConfig, WorkerDied
from tests.models import BYTE_MODEL_SEED, greedy_reference, reference_copy, tiny_model
from tests.procs import reap, start_worker

SEED = BYTE_MODEL_SEED  # the target_dir fixture's model (conftest.py)


def engine(
    target: Path,
    drafter: str,
    draft: Path | None = None,
    *,
    async_scheduling: bool | None = False,
    adaptive_speculation: bool = True,
    max_steps_in_flight: int | None = 2,
    steps_in_flight_auto: bool = False,
    device: str = "cpu",
    **kw: object,
) -> Engine:
    return Engine(
        EngineConfig(
            model=str(target),
            drafter=drafter,
            draft_model=str(draft) if draft else None,
            num_speculative_tokens=4,
            device=device,
            max_model_len=384,
            worker_max_num_seqs=8,
            scheduler=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=512,
                max_prefill_chunk=48,
                async_scheduling=async_scheduling,
                adaptive_speculation=adaptive_speculation,
                max_steps_in_flight=max_steps_in_flight,
                steps_in_flight_auto=steps_in_flight_auto,
            ),
            step_timeout_s=60,
            **kw,  # type: ignore[arg-type]
        )
    )


def started_together(*makers: Callable[[], Engine]) -> list[Engine]:
    """Engines built at once, each on its own thread: their workers import torch side by side
    (seconds each, one core apiece) instead of one after the other. If one fails to start, the
    others are closed and its error raised."""
    with ThreadPoolExecutor(len(makers)) as pool:
        futures = [pool.submit(make) for make in makers]
    errors = [f.exception() for f in futures]
    made = [f.result() for f, e in zip(futures, errors, strict=True) if e is None]
    if len(made) < len(makers):
        for e in made:
            e.close()
        raise next(err for err in errors if err is not None)
    return made


@pytest.fixture(scope="module", params=["none", "ngram", "draft_model"])
def eng(request: pytest.FixtureRequest, target_dir: Path, draft_dir: Path) -> Iterator[Engine]:
    e = engine(target_dir, request.param, draft_dir if request.param == "draft_model" else None)
    yield e
    e.close()


def prompts(n: int) -> list[list[int]]:
    base = [
        list(b"the cat sat on the mat. the cat sat"),
        list(b'{"name": "ab'),
        list(b"12121212"),
        list(b"hello world"),
        list(b"abcabcabcabcabc"),
        list(b"x"),
        list(b"aaaa bbbb aaaa"),
        list(b"The quick brown fox jumps over the lazy dog " * 2),
    ]
    return base[:n]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_through_two_processes_equals_target_greedy(eng: Engine, batch: int) -> None:
    ref = reference_copy(tiny_model("llama", SEED, vocab=259))
    ps = prompts(batch)
    reqs = eng.generate(
        [
            {"prompt": p, "max_tokens": 20, "ignore_eos": True, "num_speculative_tokens": i % 5}
            for i, p in enumerate(ps)
        ]
    )
    for r, p in zip(reqs, ps, strict=True):
        assert r.error is None, r.error
        assert r.output_ids == greedy_reference(ref, p, 20), r.req_id


SCHEMAS = [
    {  # nested object, enum, bounded integer
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "role": {"enum": ["admin", "guest"]},
                },
                "required": ["name", "role"],
            },
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["user", "age"],
    },
    {  # array with bounded items, pattern string
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                "minItems": 1,
                "maxItems": 3,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested-enum-int", "array-pattern", "int-array"])
def test_json_schema_outputs_validate(eng: Engine, schema: dict[str, object]) -> None:
    reqs = eng.generate(
        [
            {
                "messages": [{"role": "user", "content": f"json please {i}"}],
                "max_tokens": 200,
                "structured": {"json": schema},
            }
            for i in range(3)
        ]
    )
    for r in reqs:
        assert r.error is None, r.error
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        jsonschema.validate(json.loads(r.text), schema)


def test_regex_choice_and_lark(eng: Engine) -> None:
    lark = 'start: "ab" mid "!"\nmid: /[0-9]{2,3}/'
    reqs = eng.generate(
        [
            {
                "prompt": "phone",
                "max_tokens": 40,
                "structured": {"regex": r"\(\d{3}\) \d{3}-\d{4}"},
            },
            {
                "prompt": "pick",
                "max_tokens": 40,
                "structured": {"choice": ["red", "green", "blue"]},
            },
            {"prompt": "lark", "max_tokens": 40, "structured": {"grammar": lark}},
        ]
    )
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", reqs[0].text), reqs[0].text
    assert reqs[1].text in ("red", "green", "blue")
    assert re.fullmatch(r"ab[0-9]{2,3}!", reqs[2].text), reqs[2].text


def test_forbidden_drafts_are_dropped(target_dir: Path, draft_dir: Path) -> None:
    """A random draft model proposes bytes the grammar forbids: they are dropped (counted), and the
    output is still valid."""
    with engine(target_dir, "draft_model", draft_dir) as e:
        schema = SCHEMAS[0]
        reqs = e.generate([{"prompt": "x", "max_tokens": 200, "structured": {"json": schema}}])
        assert reqs[0].error is None
        jsonschema.validate(json.loads(reqs[0].text), schema)
        assert reqs[0].metrics.num_grammar_invalid > 0
        assert reqs[0].metrics.num_draft_tokens > 0


def test_bad_requests_fail_alone(target_dir: Path) -> None:
    with engine(target_dir, "ngram") as e:
        good = e.add_request("hello", max_tokens=8, ignore_eos=True)
        bad_schema = e.add_request("x", structured={"json": {"type": "object", "properties": 5}})
        too_long = e.add_request(list(range(3, 3 + 400)), max_tokens=4)
        victim = e.add_request("abort me", max_tokens=300, ignore_eos=True)
        e.step()
        e.step()
        e.abort(victim.req_id)
        e.run_until_done()
        assert bad_schema.finish_reason == "error" and "invalid json spec" in (
            bad_schema.error or ""
        )
        assert too_long.finish_reason == "error" and "too long" in (too_long.error or "")
        assert victim.finish_reason == "abort"
        assert good.error is None and len(good.output_ids) == 8
        # the aborted request's slot is free on the worker: it takes max_num_seqs new requests
        more = e.generate([{"prompt": "y", "max_tokens": 3, "ignore_eos": True}] * 8)
        assert all(r.error is None and len(r.output_ids) == 3 for r in more)


def test_stale_drafts_are_dropped_and_output_stays_constrained(target_dir: Path) -> None:
    with engine(target_dir, "ngram") as e:
        req = e.add_request("x", max_tokens=200, structured={"choice": ["alpha", "beta"]})
        e.step()  # prefill + first token
        import numpy as np

        from protocol import DraftTokenIds

        stale = DraftTokenIds(
            step_id=e.scheduler.last_done_step - 5,
            req_ids=[req.req_id],
            num_draft_tokens=np.array([2], np.int32),
            draft_token_ids=np.array([1, 2], np.int32),
            num_committed_tokens=np.array([req.num_tokens], np.int32),
        )
        e.scheduler.take_drafts(stale)
        assert len(req.draft_ids) == 0 and req.metrics.num_stale == 1
        e.run_until_done()
        assert req.error is None and req.text in ("alpha", "beta")


def test_worker_killed_mid_run_is_reported_from_its_exit(target_dir: Path) -> None:
    """The death is seen from the process's exit (about 0.2 s here, under load), not after the
    60 s step timeout; the limit is 100 times the typical time and a third of that timeout."""
    e = engine(target_dir, "ngram", max_worker_restarts=0)
    try:
        reqs = [e.add_request("long", max_tokens=300, ignore_eos=True) for _ in range(3)]
        for _ in range(3):
            e.step()
        assert e.proc is not None
        pid = e.proc.pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            while True:
                e.step()
        assert time.monotonic() - t0 < 20
        assert str(info.value) == f"worker process {pid} exited with code -9"
        assert all(r.finish_reason == "error" and "worker died" in (r.error or "") for r in reqs)
    finally:
        e.close()


def test_specd_run_connects_to_a_running_worker(target_dir: Path, ipc_addr: str) -> None:
    worker = start_worker(target_dir, ipc_addr)
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "scheduler_client.cli",
                "run",
                "--worker",
                ipc_addr,
                "--prompt",
                "hello",
                "--max-tokens",
                "6",
                "--choice",
                "yes",
                "no",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines()]
        assert lines[0]["text"] in ("yes", "no") and lines[0]["error"] is None
        assert "mean_acceptance_length" in lines[-1]["metrics"]
        assert worker.poll() is None, "a worker we did not launch must keep running"
    finally:
        reap(worker)


def test_missed_pings_detect_a_frozen_worker_we_did_not_launch(
    target_dir: Path, ipc_addr: str
) -> None:
    """SIGSTOP: the process lives but answers nothing; pings find out (3 pings 0.2 s apart: about
    0.8 s here; the limit is well over 10 times that and under the ping's own 30 s timeout)."""
    from scheduler_client.worker_client import WorkerClient

    worker = start_worker(target_dir, ipc_addr)
    client = WorkerClient(ipc_addr, step_timeout_s=60, ping_interval_s=0.2, max_missed_pings=3)
    try:
        client.handshake(timeout_s=120)
        assert client.ping().seq == 1
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match="missed 3 pings"):
            client.ping(timeout_s=30)
        assert time.monotonic() - t0 < 15
    finally:
        client.close()
        reap(worker)  # SIGKILL works on a stopped process


EBNF = 'root ::= "ab" digits "!"\ndigits ::= [0-9] [0-9] [0-9]?'


def test_ebnf_with_llguidance(eng: Engine) -> None:
    (r,) = eng.generate([{"prompt": "ebnf", "max_tokens": 40, "structured": {"ebnf": EBNF}}])
    assert r.error is None and re.fullmatch(r"ab[0-9]{2,3}!", r.text), (r.error, r.text)


@pytest.fixture(scope="module")
def xgr_engine(target_dir: Path, draft_dir: Path) -> Iterator[Engine]:
    pytest.importorskip("xgrammar")
    e = engine(target_dir, "draft_model", draft_dir, grammar_backend="xgrammar")
    yield e
    e.close()


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested-enum-int", "array-pattern", "int-array"])
def test_xgrammar_backend_json(xgr_engine: Engine, schema: dict[str, object]) -> None:
    reqs = xgr_engine.generate(
        [{"prompt": f"j{i}", "max_tokens": 200, "structured": {"json": schema}} for i in range(2)]
    )
    for r in reqs:
        assert r.error is None and r.finish_reason == "stop", (r.error, r.text)
        jsonschema.validate(json.loads(r.text), schema)


def test_xgrammar_backend_regex_choice_ebnf(xgr_engine: Engine) -> None:
    reqs = xgr_engine.generate(
        [
            {"prompt": "p", "max_tokens": 40, "structured": {"regex": r"[a-c]{3}-\d{2}"}},
            {"prompt": "c", "max_tokens": 40, "structured": {"choice": ["left", "right"]}},
            {"prompt": "e", "max_tokens": 40, "structured": {"ebnf": EBNF}},
            {"prompt": "l", "max_tokens": 40, "structured": {"grammar": 'start: "x"'}},
        ]
    )
    assert re.fullmatch(r"[a-c]{3}-\d{2}", reqs[0].text), reqs[0].text
    assert reqs[1].text in ("left", "right")
    assert re.fullmatch(r"ab[0-9]{2,3}!", reqs[2].text), reqs[2].text
    assert reqs[3].finish_reason == "error" and "EBNF" in (reqs[3].error or "")
    assert sum(r.metrics.num_grammar_invalid for r in reqs) > 0


def test_kill_9_mid_run_restarts_the_worker_and_replays_identically(
    target_dir: Path, draft_dir: Path
) -> None:
    """The scheduler is the source of truth: a killed worker is relaunched, every in-flight request
    is replayed from prompt + committed tokens, and greedy outputs equal an uninterrupted run."""
    batch = [
        {"prompt": p, "max_tokens": 40, "ignore_eos": True, "num_speculative_tokens": i % 5}
        for i, p in enumerate(prompts(5))
    ] + [{"prompt": "j", "max_tokens": 200, "structured": {"json": SCHEMAS[1]}}]
    with engine(target_dir, "draft_model", draft_dir) as e:
        want = [(r.output_ids, r.text) for r in e.generate(batch)]
    with engine(target_dir, "draft_model", draft_dir) as e:
        reqs = [e.add_request(**r) for r in batch]
        for _ in range(4):
            e.step()
        assert any(r.output_ids for r in reqs) and not all(r.finished for r in reqs)
        assert e.proc is not None
        old = e.proc.pid
        os.kill(old, signal.SIGKILL)
        t0 = time.monotonic()
        e.step()  # notices the death, relaunches, requeues
        assert e.num_worker_restarts == 1 and e.proc.pid != old
        assert time.monotonic() - t0 < 120  # a fresh worker's start: about 10 s here, under load
        e.run_until_done()
        assert [(r.output_ids, r.text) for r in reqs] == want
        assert all(r.error is None for r in reqs)


def test_stop_conditions_and_streaming(eng: Engine) -> None:
    (free,) = eng.generate([{"prompt": "abc", "max_tokens": 24, "ignore_eos": True}])
    assert free.finish_reason == "length" and len(free.output_ids) == 24
    # a stop string taken from the middle of the free run cuts the text right before it
    text = free.text
    stop = next(
        text[i : i + 2]
        for i in range(4, len(text) - 2)
        if text[i : i + 2].isprintable() and text.find(text[i : i + 2]) == i
    )
    (cut,) = eng.generate([{"prompt": "abc", "max_tokens": 24, "ignore_eos": True, "stop": [stop]}])
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    # a stop token id ends the request before that token
    t = free.output_ids[5]
    (tok,) = eng.generate(
        [{"prompt": "abc", "max_tokens": 24, "ignore_eos": True, "stop_token_ids": [t]}]
    )
    assert (
        tok.finish_reason == "stop"
        and tok.output_ids == free.output_ids[: free.output_ids.index(t)]
    )
    # streaming yields the same text, piece by piece
    pieces = list(eng.stream("abc", max_tokens=24, ignore_eos=True))
    assert "".join(pieces) == text and len(pieces) > 1
