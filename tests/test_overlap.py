"""Overlap (async) scheduling through two real processes: the next step is sent before this one's
output arrives, widths are caps, structured greedy requests get deferred grammar rows. Lossless
and grammar-safe like sync mode (CPU, float32, tiny byte-level models)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import msgspec
import numpy as np
import pytest

from protocol.messages import SchedulerOutput
from scheduler_client import Engine
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from tests.models import greedy_reference, reference_copy, tiny_model
from tests.test_operations import assert_cycles_add_up
from tests.test_scheduler_e2e import SCHEMAS, SEED, engine, prompts, started_together


@pytest.fixture(scope="module", params=["none", "ngram", "draft_model"])
def pair(
    request: pytest.FixtureRequest, target_dir: Path, draft_dir: Path
) -> Iterator[tuple[Engine, Engine]]:
    draft = draft_dir if request.param == "draft_model" else None
    sync, over = started_together(
        lambda: engine(target_dir, request.param, draft),
        lambda: engine(target_dir, request.param, draft, async_scheduling=True),
    )
    yield sync, over
    sync.close()
    over.close()


def check_greedy(over: Engine, batch: int) -> None:
    """``batch`` greedy requests finishing at different steps while steps are in flight, each
    with its own speculation length: every output equals target-only greedy."""
    ref = reference_copy(tiny_model("llama", SEED, vocab=259))
    ps = prompts(batch)
    reqs = over.generate(
        [
            {
                "prompt": p,
                "max_tokens": 7 + 5 * i,
                "ignore_eos": True,
                "num_speculative_tokens": i % 5,
            }
            for i, p in enumerate(ps)
        ]
    )
    for i, (r, p) in enumerate(zip(reqs, ps, strict=True)):
        assert r.error is None, r.error
        assert r.output_ids == greedy_reference(ref, p, 7 + 5 * i), r.req_id
    assert not over.scheduler.steps and not over.in_flight


def check_structured_greedy(sync: Engine, over: Engine) -> None:
    """Structured greedy requests (their rows deferred) beside a plain one: the same tokens as
    sync mode, and valid, with rows sent before the rest of an output is committed among them."""
    work = [
        {
            "messages": [{"role": "user", "content": f"json please {i}"}],
            "max_tokens": 160,
            "structured": {"json": schema},
        }
        for i, schema in enumerate(SCHEMAS)
    ] + [{"prompt": list(b"the cat sat on the mat. the cat"), "max_tokens": 40, "ignore_eos": True}]
    before = over.num_deferred_bitmasks
    want = sync.generate([dict(w) for w in work])
    got = over.generate([dict(w) for w in work])
    for w, s, o in zip(work, want, got, strict=True):
        assert o.error is None, o.error
        assert o.output_ids == s.output_ids
        if "structured" in w:
            jsonschema.validate(json.loads(o.text), w["structured"]["json"])  # type: ignore[index]
    assert over.num_deferred_bitmasks > before, "no structured step was deferred"
    # where no drafts followed a step, its successor's rows went before the rest committed
    assert over.num_early_bitmasks > 0, "no deferred rows were sent early"


@pytest.mark.parametrize("batch", [1, 8])
def test_overlap_greedy_equals_target_greedy(pair: tuple[Engine, Engine], batch: int) -> None:
    _, over = pair
    assert over.overlap
    check_greedy(over, batch)


def test_overlap_with_the_tuner_verifies_drafts(pair: tuple[Engine, Engine]) -> None:
    """With overlap a step's widths are caps and a request runs only the drafts the worker
    proposed. The tuner used to file each step under its caps, so it never measured the no-draft
    width, kept proposing zero drafts to measure it, and overlap never speculated (served n-gram
    at c=1 on the H200 verified no draft). Repetitive prompts, one at a time, the tuner on."""
    _, over = pair
    assert over.scheduler.tuner is not None
    drafted = 0
    for i, p in enumerate([prompts(8)[0], prompts(8)[4], prompts(8)[7]] * 2):
        (r,) = over.generate([{"prompt": p, "max_tokens": 40, "ignore_eos": True}])
        assert r.error is None, r.error
        # the first requests draft while the tuner measures; count those after it
        drafted += r.metrics.num_draft_tokens if i >= 3 else 0
    if over.config.drafter == "none":
        assert drafted == 0
        return
    # both ends measured at batch 1: the tuner chooses, it is not stuck measuring
    known = over.scheduler.tuner._buckets[1, False].seconds
    assert 1 in known and 1 + over.config.num_speculative_tokens in known, known
    if over.config.drafter == "ngram":  # drafting costs nothing: it pays on these prompts
        assert drafted > 0, "overlap with the tuner verified no drafts"


def test_overlap_structured_greedy_equals_sync_and_validates(pair: tuple[Engine, Engine]) -> None:
    check_structured_greedy(*pair)


def test_overlap_sampled_structured_waits_for_its_rows(pair: tuple[Engine, Engine]) -> None:
    """A sampled structured request is never deferred (a cap is exact for greedy only): it
    still finishes valid next to greedy requests that overlap."""
    _, over = pair
    schema = SCHEMAS[0]
    reqs = over.generate(
        [
            {
                "messages": [{"role": "user", "content": "json"}],
                "max_tokens": 160,
                "structured": {"json": schema},
                "temperature": 0.8,
                "seed": 3,
            },
            {"prompt": list(b"abcabcabcabc"), "max_tokens": 30, "ignore_eos": True},
        ]
    )
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    jsonschema.validate(json.loads(reqs[0].text), schema)


@pytest.mark.parametrize("depth", [2, 3])
def test_a_refused_step_with_the_next_already_queued_loses_nothing(
    target_dir: Path, depth: int
) -> None:
    """The worker refuses step n (a request it does not hold, injected) while step n+1 (and with
    depth 3, n+2) is already queued behind it: the scheduler settles step n's books, the later
    steps run on the worker's own state, and every output still equals target-only greedy."""
    ref = reference_copy(tiny_model("llama", SEED, vocab=259))
    eng = engine(target_dir, "ngram", async_scheduling=True, max_steps_in_flight=depth)
    try:
        real = eng.scheduler.schedule
        calls = [0]

        def schedule_with_a_ghost() -> SchedulerOutput | None:
            out = real()
            calls[0] += 1
            if out is None or calls[0] not in (3, 8):  # two refusals, in each batch
                return out
            return msgspec.structs.replace(
                out,
                req_ids=[*out.req_ids, "ghost"],
                num_scheduled_tokens=np.append(out.num_scheduled_tokens, 1).astype(np.int32),
                num_draft_tokens=np.append(out.num_draft_tokens, 0).astype(np.int32),
            )

        eng.scheduler.schedule = schedule_with_a_ghost  # type: ignore[method-assign]
        ps = prompts(8)
        reqs = eng.generate([{"prompt": p, "max_tokens": 16, "ignore_eos": True} for p in ps[:3]])
        late = eng.generate([{"prompt": p, "max_tokens": 12, "ignore_eos": True} for p in ps[3:]])
        for r, p in zip(reqs + late, ps, strict=True):
            assert r.error is None, r.error
            assert r.output_ids == greedy_reference(ref, p, r.sampling.max_tokens)
        assert calls[0] >= 8
    finally:
        eng.close()


def test_overlap_steps_queue_behind_the_one_before_and_their_cycles_add_up(
    target_dir: Path, tmp_path: Path
) -> None:
    """With overlap and no drafter, a step is sent before the output ahead of it (``queued`` in
    the step trace), and each step's time is the cycle from that output: consecutive steps'
    times add up to the wall time between their outputs."""
    trace_file = tmp_path / "steps.jsonl"
    eng = engine(target_dir, "none", async_scheduling=True, step_trace=str(trace_file))
    try:
        reqs = eng.generate(
            [{"prompt": p, "max_tokens": 24, "ignore_eos": True} for p in prompts(4)]
        )
        assert all(r.error is None for r in reqs)
    finally:
        eng.close()
    trace = [json.loads(x) for x in trace_file.read_text().splitlines()]
    assert sum(x["queued"] for x in trace) > len(trace) // 2, trace
    assert not any(x["deferred"] for x in trace)  # no structured request
    assert_cycles_add_up(trace)


def test_the_step_trace_marks_steps_whose_grammar_rows_were_deferred(
    target_dir: Path, tmp_path: Path
) -> None:
    """Overlap: the steps of a structured greedy request after its first carry its grammar rows
    in a later message; the trace marks them (``deferred``), as the tuner times them apart."""
    trace_file = tmp_path / "steps.jsonl"
    eng = engine(target_dir, "none", async_scheduling=True, step_trace=str(trace_file))
    try:
        chat = [{"role": "user", "content": "json please"}]
        body = {"messages": chat, "max_tokens": 40, "structured": {"json": SCHEMAS[0]}}
        (r,) = eng.generate([body])
        assert r.error is None, r.error
    finally:
        eng.close()
    trace = [json.loads(x) for x in trace_file.read_text().splitlines()]
    assert not trace[0]["deferred"] and sum(x["deferred"] for x in trace) >= len(trace) // 2


def test_auto_steps_in_flight_is_lossless_and_keeps_two_while_the_worker_drafts(
    target_dir: Path, draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-steps-in-flight auto: with a draft model drafting every step, the depth goes from
    three (nothing measured yet) to two, and greedy output equals target-only greedy across the
    change; a worker that never drafts keeps three (its --pipeline-steps needs them). The
    turnaround bar is raised (SHALLOW) so that the tiny CPU models' times do not decide."""
    import scheduler_client.engine as engine_module

    monkeypatch.setattr(engine_module, "SHALLOW", 100.0)
    seen: dict[str, list[int]] = {}
    for drafter in ("draft_model", "none"):
        eng = engine(
            target_dir, drafter, draft_dir if drafter == "draft_model" else None,
            async_scheduling=True, adaptive_speculation=False, max_steps_in_flight=3,
            steps_in_flight_auto=True,
        )  # fmt: skip
        try:
            depths = seen[drafter] = []
            real = eng._depth

            def depth(real: Callable[[], int] = real, depths: list[int] = depths) -> int:
                depths.append(real())
                return depths[-1]

            eng._depth = depth  # type: ignore[method-assign]
            check_greedy(eng, 6)
            assert eng._cycle_s > 0 and eng._turnaround_s > 0  # both measured
        finally:
            eng.close()
    assert set(seen["draft_model"]) == {2, 3} and seen["draft_model"][0] == 3
    assert set(seen["none"]) == {3}


def test_the_auto_depth_follows_the_turnaround_against_the_time_between_outputs() -> None:
    from types import SimpleNamespace

    cfg = SchedulerConfig(async_scheduling=True, max_steps_in_flight=3, steps_in_flight_auto=True)
    eng = SimpleNamespace(
        scheduler=SimpleNamespace(config=cfg, max_steps_in_flight=3),
        _drafting=True,
        _cycle_s=0.007,
        _turnaround_s=0.0015,
    )  # a draft model's step on an H100
    assert Engine._depth(eng) == 2  # type: ignore[arg-type]
    eng._cycle_s, eng._turnaround_s = 0.0025, 0.0017  # a short step, a long turnaround
    assert Engine._depth(eng) == 3  # type: ignore[arg-type]
    eng._drafting, eng._cycle_s, eng._turnaround_s = False, 0.007, 0.0015
    assert Engine._depth(eng) == 3  # type: ignore[arg-type]  # the worker does not draft
    eng._drafting, eng._cycle_s = True, 0.0  # nothing measured yet
    assert Engine._depth(eng) == 3  # type: ignore[arg-type]


def test_max_steps_in_flight_auto_on_the_command_line_and_in_a_config_file(
    tmp_path: Path,
) -> None:
    import argparse

    from protocol.options import load_toml
    from scheduler_client.engine_args import add_engine_args, engine_config

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    base = ["--model", "m", "--async-scheduling"]
    cfg = engine_config(ap.parse_args([*base, "--max-steps-in-flight", "auto"])).scheduler
    assert (cfg.max_steps_in_flight, cfg.steps_in_flight_auto) == (3, True)
    cfg = engine_config(ap.parse_args([*base, "--max-steps-in-flight", "3"])).scheduler
    assert (cfg.max_steps_in_flight, cfg.steps_in_flight_auto) == (3, False)
    with pytest.raises(SystemExit):
        ap.parse_args([*base, "--max-steps-in-flight", "deep"])
    toml = tmp_path / "s.toml"
    for text, want in (("3", 3), ('"auto"', "auto")):
        toml.write_text(f"max-steps-in-flight = {text}\n")
        assert load_toml(str(toml), ap)["max_steps_in_flight"] == want
    toml.write_text("max-steps-in-flight = true\n")
    with pytest.raises(ValueError, match="max-steps-in-flight"):
        load_toml(str(toml), ap)


def test_the_scheduling_mode_left_to_the_worker_follows_its_handshake(tmp_path: Path) -> None:
    """``specd-scheduler`` without --async-scheduling or --max-steps-in-flight leaves them to
    the worker: one that leaves steps open (``WorkerReady.pipeline_steps``, a CUDA worker's
    default) gets overlap with three steps in flight, any other sync; a user's choice stands.
    The worker's --pipeline-steps defaults to None (on where the GPU runs the kernels), and
    --worker-args reaches a launched worker."""
    import argparse

    from protocol.options import load_toml
    from scheduler_client.engine_args import add_engine_args, engine_config
    from scheduler_client.scheduler import resolve_mode
    from tests.test_spec_tuner import small_limits
    from worker.config import parse_args

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    left = engine_config(ap.parse_args(["--model", "m"]))
    assert (left.scheduler.async_scheduling, left.scheduler.max_steps_in_flight) == (None, None)
    limits = small_limits(4)
    piped = dataclasses.replace(limits, pipeline_steps=True)

    def mode(flags: list[str], worker: WorkerLimits) -> tuple[bool | None, int | None]:
        return resolve_mode(
            engine_config(ap.parse_args(["--model", "m", *flags])).scheduler, worker
        )

    assert mode([], piped) == (True, 3)
    assert mode([], limits) == (False, 2)
    assert mode(["--async-scheduling"], limits) == (True, 2)
    assert mode(["--no-async-scheduling"], piped) == (False, 2)
    assert mode(["--max-steps-in-flight", "2"], piped) == (True, 2)
    s = Scheduler(
        SchedulerConfig(async_scheduling=None, max_steps_in_flight=None), piped, None, None
    )
    assert (s.async_scheduling, s.max_steps_in_flight) == (True, 3)
    toml = tmp_path / "s.toml"
    toml.write_text("async-scheduling = false\n")
    assert load_toml(str(toml), ap)["async_scheduling"] is False
    args = '--worker-args=--no-pipeline-steps --dtype "float16"'
    assert engine_config(ap.parse_args(["--model", "m", args])).worker_args == (
        "--no-pipeline-steps",
        "--dtype",
        "float16",
    )
    # one flag as the value, after a space: argparse alone says --worker-args has no value
    from scheduler_client.daemon import parse_args as serve_args

    one = serve_args(["--model", "m", "--worker-args", "--pipeline-steps", "--port", "0"])
    assert one.engine.worker_args == ("--pipeline-steps",) and one.port == 0
    with pytest.raises(ValueError, match="--worker-args applies to a launched worker"):
        engine_config(ap.parse_args(["--worker", "ipc:///x", "--worker-args=--dtype=float16"]))
    # the Python API leaves them to the worker as well: a CPU worker's (no open steps) is sync
    assert resolve_mode(SchedulerConfig(), limits) == (False, 2)
    assert parse_args(["--model", "m"]).pipeline_steps is None
    assert parse_args(["--model", "m", "--pipeline-steps"]).pipeline_steps is True
    assert parse_args(["--model", "m", "--no-pipeline-steps"]).pipeline_steps is False
