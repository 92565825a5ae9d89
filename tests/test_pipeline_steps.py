"""``--pipeline-steps``: a step with no drafts is left open (its sampled tokens on the device) and
the next step is launched before it is finished, its layout reading those tokens on the device.
Lossless like every other path: in process, steps interleaved by hand as the worker's loop does
(requests leaving and their slots taken while a step is open); then through two real processes
with overlap scheduling, against the same engine without the flag (CPU, float32, tiny models)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import msgspec
import numpy as np
import pytest
import torch

from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
from scheduler_client import Engine
from tests.drafting import K, drafting_runner
from tests.models import greedy_reference, reference_copy, tiny_model
from tests.test_catch_up import drafts_of
from tests.test_overlap import check_greedy, check_structured_greedy
from tests.test_scheduler_e2e import SCHEMAS, SEED, engine, prompts, started_together
from worker.drafters.base import NoDrafter
from worker.drafters.eagle import EagleDrafter
from worker.model_executor import ModelExecutor
from worker.runner import LaunchedStep, ModelRunner

MAX_LEN = 64


def runner(seed: int = 11, max_num_seqs: int = 2) -> ModelRunner:
    return ModelRunner(
        ModelExecutor(tiny_model("llama", seed), max_num_seqs=max_num_seqs, max_model_len=MAX_LEN),
        NoDrafter(),
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=0,
    )


def new(req_id: str, prompt: list[int], k: int = 0, **sampling: object) -> NewRequest:
    return NewRequest(req_id, np.array(prompt, np.int32), SamplingParams(**sampling), k)  # type: ignore[arg-type]


def sched(
    step_id: int,
    counts: dict[str, int],
    new_requests: list[NewRequest] = (),  # type: ignore[assignment]
    finished: list[str] = (),  # type: ignore[assignment]
) -> SchedulerOutput:
    n = len(counts)
    return SchedulerOutput(
        step_id=step_id,
        new_requests=list(new_requests),
        req_ids=list(counts),
        num_scheduled_tokens=np.array(list(counts.values()), np.int32),
        num_draft_tokens=np.zeros(n, np.int32),
        draft_token_ids=np.zeros(0, np.int32),
        finished_req_ids=list(finished),
        aborted_req_ids=[],
        structured_req_ids=[],
    )


class Overlapped:
    """Drives a runner as the worker's loop does with --pipeline-steps and a scheduler that sends
    step n + 1 before step n's output: launch n + 1 (held), then finish n."""

    def __init__(self, r: ModelRunner) -> None:
        self.r = r
        self.open: LaunchedStep | None = None
        self.out: dict[str, list[int]] = {}
        self.pipelined = 0
        self.drafts: list[tuple[int, list[str], list[int]]] = []  # step, samplers, committed
        self.widths: dict[str, int] = {}  # each request's drafts in the last DraftTokenIds
        self.verified: list[list[int]] = []  # each output's drafts verified per request

    def step(self, s: SchedulerOutput) -> None:
        launched = self.r.launch(s, hold=True)
        if self.open is not None:
            self.pipelined += 1
            self.take(self.open)
        self.open = launched if launched.open else None
        if not launched.open:
            self.take(launched)

    def drain(self) -> None:
        if self.open is not None:
            self.take(self.open)
            self.open = None

    def take(self, launched: LaunchedStep) -> None:
        out, rejected = self.r.finish(launched)
        assert not rejected
        self.verified.append(out.num_draft_tokens.tolist())
        # the scheduler waits for a DraftTokenIds after every output that sampled: each sampler
        # listed, with its committed length after this step (whoever left since)
        drafts = self.r.take_draft_tokens()
        samplers = [r for r, n in zip(out.req_ids, out.num_sampled.tolist(), strict=True) if n]
        if samplers:
            assert drafts is not None and drafts.step_id == out.step_id
            assert list(drafts.req_ids) == samplers
            self.drafts.append((drafts.step_id, samplers, drafts.num_committed_tokens.tolist()))
            self.widths.update(zip(drafts.req_ids, drafts.num_draft_tokens.tolist(), strict=True))
        else:
            assert drafts is None
        flat = out.sampled_token_ids.tolist()
        off = 0
        for req_id, n in zip(out.req_ids, out.num_sampled.tolist(), strict=True):
            self.out.setdefault(req_id, []).extend(flat[off : off + n])
            off += n


def run_arrivals_and_a_taken_slot(r: ModelRunner, ref: torch.nn.Module) -> None:
    """Every step launched behind an open one, on ``r`` (two slots, no drafter): "b" arrives
    while "a" decodes (a mixed step), then "a" leaves while its last token is open and "c" takes
    its slot in that step (c's longer prompt must not receive a's token). Outputs equal
    target-only greedy, and every step's DraftTokenIds lists its samplers at their lengths."""
    pa, pb, pc = [3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1, 2, 3, 1, 2, 3, 1, 2, 5, 6, 7, 8, 9, 4]
    drv = Overlapped(r)
    drv.step(sched(0, {"a": len(pa)}, [new("a", pa)]))
    drv.step(sched(1, {"a": 1, "b": len(pb)}, [new("b", pb)]))
    for i in range(2, 8):
        drv.step(sched(i, {"a": 1, "b": 1}))
    # a's eighth token is still open when this step lets a go and admits c
    drv.step(sched(8, {"b": 1, "c": len(pc)}, [new("c", pc)], finished=["a"]))
    for i in range(9, 20):
        drv.step(sched(i, {"b": 1, "c": 1}))
    drv.drain()
    assert drv.pipelined == 19
    # the scheduler drops the token a sampled in the step it was let go in (step 8)
    assert drv.out["a"][:8] == greedy_reference(ref, pa, 8)
    assert drv.out["b"] == greedy_reference(ref, pb, 19)
    assert drv.out["c"] == greedy_reference(ref, pc, 12)
    # step 7's DraftTokenIds, answered after step 8 let a go, still lists a at its length
    assert drv.drafts[7] == (7, ["a", "b"], [len(pa) + 8, len(pb) + 7])
    # a's open token (position 12) was read back after c took the slot: it went nowhere
    st = r.states
    assert st.tokens(st.slot_of["c"]).tolist() == pc + drv.out["c"]
    assert st.tokens(st.slot_of["b"]).tolist() == pb + drv.out["b"]


def test_open_steps_greedy_equals_target_greedy() -> None:
    run_arrivals_and_a_taken_slot(runner(), reference_copy(tiny_model("llama", 11)))


def test_open_steps_sampled_equal_closed_steps() -> None:
    """Seeded sampled requests draw the same tokens whether their steps are left open or not,
    and a request at its length limit samples past it without a write out of bounds."""

    def run(hold: bool) -> tuple[dict[str, list[int]], list[tuple[int, list[str], list[int]]]]:
        r = runner(12)
        drv = Overlapped(r)
        long = list(range(1, MAX_LEN - 3))  # three tokens of room
        reqs = [new("s", [5, 6, 7], temperature=0.9, seed=3), new("g", long)]
        first = sched(0, {"s": 3, "g": len(long)}, reqs)
        steps = [first, *(sched(i, {"s": 1, "g": 1}) for i in range(1, 4))]
        steps += [sched(i, {"s": 1}, finished=["g"] if i == 4 else []) for i in range(4, 9)]
        for s in steps:
            if hold:
                drv.step(s)
            else:
                drv.take(r.launch(s))
        drv.drain()
        assert drv.pipelined == (8 if hold else 0)
        return drv.out, drv.drafts

    (open_, open_drafts), (closed, closed_drafts) = run(True), run(False)
    assert open_ == closed
    assert open_drafts == closed_drafts  # g's last, read back after g left, listed all the same
    assert len(open_["s"]) == 9 and len(open_["g"]) == 4


def test_a_step_is_left_open_only_when_it_proposes_nothing() -> None:
    """With a drafter, a step that proposes drafts after it (the drafter reads the committed
    tokens) is closed; one whose proposals the scheduler caps at zero, or whose samplers have no
    speculation length, is left open."""
    r, _ = drafting_runner("ngram", 13)
    launched = r.launch(sched(0, {"a": 4}, [new("a", [1, 2, 1, 2], k=2)]), hold=True)
    assert not launched.open
    out, _ = r.finish(launched)
    assert out.num_sampled.tolist() == [1]
    for step_id, cap, held in ((1, -1, False), (2, 2, False), (3, 0, True)):
        s = msgspec.structs.replace(sched(step_id, {"a": 1}), max_draft_proposals=cap)
        launched = r.launch(s, hold=True)
        assert launched.open == held, cap
        r.finish(launched)
    r.states.num_speculative[r.states.slot_of["a"]] = 0  # the request asked for no drafts
    launched = r.launch(sched(10, {"a": 1}), hold=True)
    assert launched.open
    r.finish(launched)


def run_tuner_pattern(
    r: ModelRunner, hold: bool, widths_are_caps: bool, steps: int = 18
) -> Overlapped:
    """Two requests, the scheduler's proposal cap at zero for most steps and at K every fourth
    (a tuner re-measuring a drafter it turned down); with ``hold`` every step that proposes
    nothing is left open. The step after a proposal verifies what was proposed. With
    ``widths_are_caps`` (overlap scheduling, whose tuner chooses a width before it knows what
    was proposed) every decode step sends K placeholders as a cap and runs the drafts the
    worker holds: none after a step that proposed none, even while that step is open. Every
    other proposal is then left unverified (a width of 0 the step after it), so the step after
    that, launched behind it, must not run the drafts proposed two steps before."""
    pa, pb = [5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12, 9]
    drv = Overlapped(r)
    prev_cap = 0
    for i in range(steps):
        cap = K if i % 4 == 2 else 0
        # drafts proposed after the previous step; none when it proposed nothing (the
        # scheduler knows its own cap: that step may still be open)
        widths = {q: drv.widths.get(q, 0) if prev_cap else 0 for q in ("a", "b")}
        if widths_are_caps:
            w_cap = 0 if i % 8 == 3 else K
            widths = {"a": w_cap, "b": w_cap}
        if i == 0:
            counts = {"a": len(pa), "b": len(pb)}
            news = [new("a", pa, k=K), new("b", pb, k=K)]
        else:
            counts, news = {"a": 1 + widths["a"], "b": 1 + widths["b"]}, []
        s = sched(i, counts, news)
        w = np.array([widths.get(q, 0) if i else 0 for q in counts], np.int32)
        s = msgspec.structs.replace(
            s,
            num_draft_tokens=w,
            draft_token_ids=np.full(int(w.sum()), -1, np.int32),
            max_draft_proposals=cap,
            draft_widths_are_caps=widths_are_caps,
        )
        if hold:
            drv.step(s)
        else:
            drv.take(r.launch(s))
        prev_cap = cap
    drv.drain()
    return drv


@pytest.mark.parametrize("widths_are_caps", [False, True], ids=["widths", "caps"])
@pytest.mark.parametrize("kind", ["ngram", "draft_model", "eagle"])
def test_a_drafter_turned_down_to_zero_leaves_its_steps_open(
    kind: str, widths_are_caps: bool
) -> None:
    check_drafter_turned_down(kind, "cpu", widths_are_caps)


def check_drafter_turned_down(
    kind: str, device: str, widths_are_caps: bool, cuda_graphs: bool = True
) -> None:
    """The steps a tuner leaves at zero width are held as with no drafter, and the output, each
    DraftTokenIds and every proposal are those of the same steps closed: the drafter caught up
    from tokens read back late (the EAGLE head from hidden states fed by the held steps), and
    the output is target-only greedy."""
    runs = {}
    features = []  # the EAGLE head's store of the target's hidden states, after each run
    for hold in (True, False):
        r, ref = drafting_runner(kind, 21, device=device, cuda_graphs=cuda_graphs)
        proposals = drafts_of(r.drafter)
        drv = run_tuner_pattern(r, hold, widths_are_caps)
        runs[hold] = (drv.out, drv.drafts, proposals, drv.pipelined, drv.verified)
        if isinstance(r.drafter, EagleDrafter):
            features.append(r.drafter.features.clone())
    (out, drafts, proposals, pipelined, verified) = runs[True]
    (c_out, c_drafts, c_proposals, _, c_verified) = runs[False]
    assert pipelined >= 8, pipelined
    # the drafts each step verified: a step launched behind an open one that proposed nothing
    # runs none, as it would behind a closed one
    assert verified == c_verified and any(any(v) for v in verified)
    # a random head's drafts hardly depend on the features: compare what it was fed
    assert not features or torch.equal(features[0], features[1])
    assert out == c_out and drafts == c_drafts and proposals == c_proposals
    assert any(any(p) for p in proposals), "nothing was drafted"
    for q, prompt in (("a", [5, 6, 7, 5, 6, 7, 5, 6]), ("b", [9, 10, 11, 12, 9, 10, 11, 12, 9])):
        assert out[q] == greedy_reference(ref, prompt, len(out[q])), q
    assert min(len(out["a"]), len(out["b"])) >= 18


# -- through two processes ---------------------------------------------------------------------


def worker_metric(log: Path, name: str) -> float:
    """One counter of a launched worker's /metrics (its port is in its log)."""
    deadline = time.monotonic() + 30
    while not (m := re.search(r"Prometheus metrics on :(\d+)/metrics", log.read_text())):
        assert time.monotonic() < deadline, "the worker never logged its metrics port"
        time.sleep(0.1)
    with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def pair(
    target_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine, Path]]:
    log = tmp_path_factory.mktemp("pipelined") / "worker.log"
    flags = ("--pipeline-steps", "--metrics-port", "-1")
    plain, piped = started_together(
        lambda: engine(target_dir, "none", async_scheduling=True),
        lambda: engine(
            target_dir, "none", async_scheduling=True, worker_args=flags, worker_log=str(log)
        ),
    )
    yield plain, piped, log
    plain.close()
    piped.close()


def test_pipelined_worker_greedy_equals_target_greedy(pair: tuple[Engine, Engine, Path]) -> None:
    _, piped, log = pair
    ref = reference_copy(tiny_model("llama", SEED, vocab=259))
    ps = prompts(8)
    reqs = piped.generate(
        [{"prompt": p, "max_tokens": 9 + 4 * i, "ignore_eos": True} for i, p in enumerate(ps)]
    )
    for i, (r, p) in enumerate(zip(reqs, ps, strict=True)):
        assert r.error is None, r.error
        assert r.output_ids == greedy_reference(ref, p, 9 + 4 * i), r.req_id
    assert not piped.scheduler.steps and not piped.in_flight
    assert worker_metric(log, "specd_worker_pipelined_steps_total") > 0
    # a lone request that ends on a stop token: the step after its last is let go in the step
    # after that, while it may still be open; its drafts message must come all the same (a
    # missing one stalled the scheduler for the step timeout, then restarted the worker)
    j, first, t = next(
        (j, r.output_ids, x)
        for j, r in enumerate(reqs)
        for i, x in enumerate(r.output_ids)
        if i >= 3 and x not in r.output_ids[:i]
    )
    body = {"prompt": ps[j], "max_tokens": len(first), "ignore_eos": True, "stop_token_ids": [t]}
    (stopped,) = piped.generate([body])
    assert stopped.finish_reason == "stop" and stopped.output_ids == first[: first.index(t)]
    assert piped.num_worker_restarts == 0


def test_pipelined_worker_structured_and_sampled_equal_the_plain_one(
    pair: tuple[Engine, Engine, Path],
) -> None:
    """Structured greedy requests (their rows deferred: the open step is answered when the step
    behind it starts to wait for them), seeded sampled ones, and plain ones side by side: the
    same tokens with and without the flag."""
    plain, piped, _ = pair
    ps = prompts(6)
    chat = [{"role": "user", "content": "json please"}]
    bodies = [
        {"messages": chat, "max_tokens": 160, "structured": {"json": SCHEMAS[0]}},
        {"messages": chat, "max_tokens": 160, "structured": {"json": SCHEMAS[1]}},
        {"prompt": ps[2], "max_tokens": 16, "temperature": 0.8, "seed": 7, "ignore_eos": True},
        {"prompt": ps[3], "max_tokens": 16, "temperature": 1.0, "top_k": 5, "seed": 8},
        {"prompt": ps[4], "max_tokens": 12, "ignore_eos": True},
        {"prompt": ps[5], "max_tokens": 20, "ignore_eos": True},
    ]
    before = piped.num_deferred_bitmasks
    a = plain.generate([dict(b) for b in bodies])
    b = piped.generate([dict(b) for b in bodies])
    for x, y, body in zip(a, b, bodies, strict=True):
        assert x.error is None and y.error is None, (x.error, y.error)
        assert x.output_ids == y.output_ids, body
        if "structured" in body:
            jsonschema.validate(json.loads(y.text), body["structured"]["json"])  # type: ignore[index]
    assert piped.num_deferred_bitmasks > before, "no structured step was deferred"


# -- three steps in flight (--max-steps-in-flight 3) -------------------------------------------


@pytest.fixture(scope="module", params=["none", "ngram", "ngram-chain"])
def deep(
    request: pytest.FixtureRequest, target_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine, Path]]:
    """A sync engine and one with three steps in flight (the worker pipelined where it can).
    The second leaves its mode to the worker, whose handshake says it leaves steps open: overlap
    with three steps in flight (``resolve_mode``). ``ngram-chain``: its worker leaves prompt
    lookup's drafting steps open too (``--chain-drafts``)."""
    log = tmp_path_factory.mktemp("deep") / "worker.log"
    drafter = request.param.removesuffix("-chain")
    chain = ("--chain-drafts",) if request.param.endswith("-chain") else ()
    flags = ("--pipeline-steps", "--metrics-port", "-1", *chain)
    sync, deep3 = started_together(
        lambda: engine(target_dir, drafter),
        lambda: engine(
            target_dir,
            drafter,
            async_scheduling=None,
            max_steps_in_flight=None,
            worker_args=flags,
            worker_log=str(log),
            step_trace=str(log.parent / "trace.jsonl"),
        ),
    )
    yield sync, deep3, log
    sync.close()
    deep3.close()


def test_three_steps_in_flight_greedy_equals_target_greedy(
    deep: tuple[Engine, Engine, Path],
) -> None:
    sync, deep3, log = deep
    # a CPU worker leaves no step open unless told to, and says so in its handshake
    assert not sync.ready.pipeline_steps and not sync.overlap
    assert deep3.ready.pipeline_steps and deep3.overlap
    mode = deep3.scheduler.async_scheduling, deep3.scheduler.max_steps_in_flight
    assert mode == (True, 3)
    check_greedy(deep3, 8)
    assert deep3.num_worker_restarts == 0
    if deep3.config.drafter == "none":
        assert worker_metric(log, "specd_worker_pipelined_steps_total") > 0
    if "--chain-drafts" in deep3.config.worker_args:
        assert worker_metric(log, "specd_worker_chained_steps_total") > 0


def test_three_steps_in_flight_structured_greedy_equals_sync(
    deep: tuple[Engine, Engine, Path],
) -> None:
    check_structured_greedy(deep[0], deep[1])
    assert deep[1].num_worker_restarts == 0


def test_a_step_waiting_for_deferred_rows_is_launched_behind_the_open_step(
    deep: tuple[Engine, Engine, Path],
) -> None:
    """A structured greedy request's steps after its first wait for rows the scheduler builds
    from the open step's tokens: the step is launched behind the open one all the same, and the
    open step is answered just before it waits (its forward queued meanwhile). The output is
    the sync engine's, with or without a drafter."""
    sync, deep3, log = deep
    chat = [{"role": "user", "content": "json please"}]
    body = {"messages": chat, "max_tokens": 48, "structured": {"json": SCHEMAS[0]}}
    before = worker_metric(log, "specd_worker_pipelined_steps_total")
    rows = deep3.num_deferred_bitmasks
    (want,) = sync.generate([dict(body)])
    (got,) = deep3.generate([dict(body)])
    assert got.error is None and got.output_ids == want.output_ids
    deferred = deep3.num_deferred_bitmasks - rows
    assert deferred >= len(got.output_ids) // 2, deferred
    pipelined = worker_metric(log, "specd_worker_pipelined_steps_total") - before
    if deep3.config.drafter == "none":  # (n-gram proposes after these steps: none left open)
        assert pipelined >= deferred // 2, (pipelined, deferred)
        # each step answered behind the next one says so, for the tuner's timing (protocol 1.8)
        trace = (log.parent / "trace.jsonl").read_text().splitlines()
        held = sum(json.loads(line)["held"] for line in trace)
        assert 0 < held <= worker_metric(log, "specd_worker_pipelined_steps_total")


def test_steps_that_propose_no_drafts_are_left_open_with_a_drafter(
    deep: tuple[Engine, Engine, Path],
) -> None:
    """Requests that ask for no drafts leave their steps open whatever the worker's drafter (as
    steps whose proposals the tuner caps at zero do), and stay target-only greedy."""
    _, deep3, log = deep
    before = worker_metric(log, "specd_worker_pipelined_steps_total")
    ref = reference_copy(tiny_model("llama", SEED, vocab=259))
    ps = prompts(4)
    reqs = deep3.generate(
        [
            {"prompt": p, "max_tokens": 10 + i, "ignore_eos": True, "num_speculative_tokens": 0}
            for i, p in enumerate(ps)
        ]
    )
    for i, (r, p) in enumerate(zip(reqs, ps, strict=True)):
        assert r.error is None, r.error
        assert r.output_ids == greedy_reference(ref, p, 10 + i), r.req_id
    assert worker_metric(log, "specd_worker_pipelined_steps_total") > before
    assert deep3.num_worker_restarts == 0


def test_nothing_is_proposed_for_a_request_its_step_ended() -> None:
    """After the step that ends a request (its max_tokens, or a stop token: the scheduler
    finishes it there), the drafter proposes nothing for it; a request that goes on still gets
    drafts, and a step that ended every request it sampled sends no drafts message (the
    scheduler waited for one before it scheduled the request taking the place: a draft model's
    proposal of 4, h100-s27's draft-model rows)."""
    prompt = [5, 6, 7, 8] * 4

    def first_step(a: dict[str, object], b: dict[str, object] | None) -> list[int]:
        r, _ = drafting_runner("ngram", 11)
        reqs = [new("a", prompt, 4, **a)] + ([new("b", prompt, 4, **b)] if b else [])
        step = r.launch(sched(1, {q.req_id: len(prompt) for q in reqs}, reqs))
        out, _ = r.read_output(step)
        assert step.plan is not None
        widths = list(step.plan.widths)
        assert r.will_propose(step) == any(widths)
        return [int(out.sampled_token_ids[0]), *widths]

    t, *goes_on = first_step({"max_tokens": 8}, None)
    assert goes_on == [4]
    assert first_step({"max_tokens": 1}, {"max_tokens": 8})[1:] == [0, 4]
    assert first_step({"max_tokens": 8, "stop_token_ids": (t,)}, None)[1:] == [0]
