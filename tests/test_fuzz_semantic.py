"""Semantic fuzzing of the worker: well-formed ``SchedulerOutput`` (and ``StepBitmask``) messages
with wrong meanings, beside the byte fuzzing of ``test_fuzz_worker.py``. Each message is one valid
step with one field made wrong (negative or oversized widths, arrays of the wrong length, dtype or
rank, duplicate, unknown and reused ids, ids outside the vocabulary, float bitmasks, bad row
layouts, steps out of order, deferred rows that do not fit, a handshake or a step arriving while a
step waits for its rows). Every one must be answered with a ``WorkerError`` that names the field
and the step, the worker must never exit, and afterwards a greedy request must produce exactly the
tokens a fresh worker produces. ``SPECD_FUZZ_EXAMPLES`` sets the count (10,000 in the full run,
``SPECD_FUZZ_SEED`` the seed."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from protocol import (
    PROTOCOL_MAJOR,
    DraftTokenIds,
    ModelRunnerOutput,
    NewRequest,
    Ping,
    Pong,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    StepBitmask,
    TransportConfig,
    WorkerError,
    WorkerReady,
    connect_dealer,
)
from protocol.transport import Channel
from tests.models import VOCAB, save_tiny
from tests.procs import start_worker

EXAMPLES = int(os.environ.get("SPECD_FUZZ_EXAMPLES", "1000"))
SEED = int(os.environ.get("SPECD_FUZZ_SEED", "20261203"))
K = 3
MAX_LEN = 64
WORDS = (VOCAB + 31) // 32
PROMPTS = {"r0": [5, 6, 7, 5, 6, 7, 5, 6], "r1": [9, 3, 4, 9, 3, 4, 9], "n0": [11, 12, 13, 14, 15]}
FLAGS = (
    "--drafter",
    "ngram",
    "--num-speculative-tokens",
    str(K),
    "--max-num-seqs",
    "4",
    "--max-model-len",
    str(MAX_LEN),
    "--log-level",
    "ERROR",
)

Fields = dict[str, object]


def recv(chan: Channel, timeout_ms: int = 60_000) -> object:
    got = chan.recv(timeout_ms=timeout_ms)
    assert got is not None, "the worker stopped answering"
    return got[1]


def until_pong(chan: Channel, seq: int) -> list[object]:
    """Everything the worker sent before the pong for ``seq`` (it answers in order)."""
    chan.send(Ping(seq=seq))
    got: list[object] = []
    while True:
        msg = recv(chan)
        if isinstance(msg, Pong) and msg.seq == seq:
            return got
        got.append(msg)


def step(step_id: int, **kw: object) -> SchedulerOutput:
    fields: Fields = dict(
        new_requests=[],
        req_ids=[],
        num_scheduled_tokens=np.zeros(0, np.int32),
        num_draft_tokens=np.zeros(0, np.int32),
        draft_token_ids=np.zeros(0, np.int32),
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
    )
    fields.update(kw)
    return SchedulerOutput(step_id=step_id, **fields)  # type: ignore[arg-type]


def new_request(req_id: str, prompt: object = None, **sampling: object) -> NewRequest:
    ids = np.array(PROMPTS.get(req_id, PROMPTS["n0"]), np.int32) if prompt is None else prompt
    return NewRequest(req_id, ids, SamplingParams(**sampling), K)  # type: ignore[arg-type]


def greedy_run(chan: Channel, ids: Iterator[int], req_id: str, n: int, new: bool) -> list[int]:
    """Decode ``req_id`` for ``n`` tokens, verifying whatever the worker drafts (new: prefill
    it first; otherwise it is running with ``width`` drafts from its last step)."""
    tokens: list[int] = []
    width = 0
    if new:
        prompt = PROMPTS[req_id]
        sent = step(
            next(ids),
            new_requests=[new_request(req_id)],
            req_ids=[req_id],
            num_scheduled_tokens=np.array([len(prompt)], np.int32),
            num_draft_tokens=np.zeros(1, np.int32),
        )
    while len(tokens) < n:
        if tokens or not new:
            sent = step(
                next(ids),
                req_ids=[req_id],
                num_scheduled_tokens=np.array([1 + width], np.int32),
                num_draft_tokens=np.array([width], np.int32),
                draft_token_ids=np.full(width, -1, np.int32),
            )
        chan.send(sent)
        out = recv(chan)
        assert isinstance(out, ModelRunnerOutput) and out.step_id == sent.step_id, out
        tokens += out.sampled_token_ids.tolist()
        drafts = recv(chan)
        assert isinstance(drafts, DraftTokenIds) and drafts.step_id == sent.step_id, drafts
        width = int(drafts.num_draft_tokens[0])
    return tokens[:n]


class Session:
    """A launched worker, its channel, and a step-id counter."""

    def __init__(self, model: Path, addr: str) -> None:
        self.proc = start_worker(str(model), addr, *FLAGS)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.chan = connect_dealer(self.ctx, addr, TransportConfig(send_timeout_ms=10_000))
        self.next_id = 1
        self.hello(timeout_ms=180_000)

    def hello(self, timeout_ms: int = 60_000) -> None:
        self.chan.send(
            SchedulerHello(protocol_major=PROTOCOL_MAJOR, protocol_minor=2, scheduler_id="sem")
        )
        while not isinstance(recv(self.chan, timeout_ms), WorkerReady):
            pass

    def ids(self) -> Iterator[int]:
        while True:
            self.next_id += 1
            yield self.next_id

    def close(self) -> None:
        self.chan.close()
        self.ctx.term()
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("llama", 3, tmp_path_factory.mktemp("sem-model"))


@pytest.fixture
def session(model_dir: Path, tmp_path: Path) -> Iterator[Session]:
    s = Session(model_dir, f"ipc://{tmp_path}/w.sock")
    try:
        yield s
    finally:
        s.close()


# -- the base steps and their mutations ------------------------------------------------------------
# A decode step for the running r0 and r1 (real drafts, so valid whatever the worker proposed)
# that also adds and prefills n0. Every mutation makes exactly one field wrong.


def base() -> Fields:
    return dict(
        new_requests=[new_request("n0")],
        req_ids=["r0", "r1", "n0"],
        num_scheduled_tokens=np.array([1 + K, 1 + 2, 5], np.int32),
        num_draft_tokens=np.array([K, 2, 0], np.int32),
        draft_token_ids=np.array([5, 6, 7, 8, 9], np.int32),
    )


def with_widths(f: Fields, i: int, w: int, fill: int = 5) -> None:
    """Set request i's width to w (its count follows; drafts are real ids ``fill``)."""
    widths = f["num_draft_tokens"].copy()  # type: ignore[attr-defined]
    counts = f["num_scheduled_tokens"].copy()  # type: ignore[attr-defined]
    drafts = f["draft_token_ids"].tolist()  # type: ignore[attr-defined]
    off = int(widths[:i].sum())
    drafts[off : off + int(widths[i])] = [fill] * w
    counts[i] += w - int(widths[i])
    widths[i] = w
    f.update(
        num_draft_tokens=widths,
        num_scheduled_tokens=counts,
        draft_token_ids=np.array(drafts, np.int32),
    )


ARRAYS = ("num_scheduled_tokens", "num_draft_tokens", "draft_token_ids")
Mutation = Callable[[random.Random, Fields], str]  # mutates the fields, returns the field named


def m_negative_width(rng: random.Random, f: Fields) -> str:
    i = rng.randrange(3)
    f["num_draft_tokens"][i] = -rng.randint(1, 2**31 - 1)  # type: ignore[index]
    return f"num_draft_tokens[{i}]"


def m_too_wide(rng: random.Random, f: Fields) -> str:
    i = rng.randrange(3)
    with_widths(f, i, K + rng.randint(1, 8))
    return f"num_draft_tokens[{i}]"


def m_placeholder_never_proposed(rng: random.Random, f: Fields) -> str:
    with_widths(f, 2, rng.randint(1, K), fill=-1)  # n0 is new: it has proposed nothing
    return "num_draft_tokens[2]"


def m_length(rng: random.Random, f: Fields) -> str:
    name = rng.choice(ARRAYS)
    a = f[name].tolist()  # type: ignore[attr-defined]
    a = a[:-1] if a and rng.random() < 0.5 else [*a, rng.randint(0, 5)]
    f[name] = np.array(a, np.int32)
    return name


def m_dtype(rng: random.Random, f: Fields) -> str:
    name = rng.choice(ARRAYS)
    f[name] = f[name].astype(rng.choice([np.float32, np.float16, np.bool_]))  # type: ignore[attr-defined]
    return name


def m_rank(rng: random.Random, f: Fields) -> str:
    name = rng.choice(ARRAYS)
    a = f[name]
    f[name] = a.reshape(1, -1) if rng.random() < 0.5 else a.reshape(-1, 1, 1)  # type: ignore[attr-defined]
    return name


def m_draft_out_of_vocab(rng: random.Random, f: Fields) -> str:
    j = rng.randrange(5)
    f["draft_token_ids"][j] = rng.choice(  # type: ignore[index]
        [VOCAB, VOCAB + rng.randint(1, 10**6), 2**31 - 1, -2, -rng.randint(3, 2**31)]
    )
    return f"draft_token_ids[{j}]"


def m_duplicate_req_id(rng: random.Random, f: Fields) -> str:
    i = rng.choice([1, 2])
    f["req_ids"][i] = f["req_ids"][rng.randrange(i)]  # type: ignore[index]
    return f"req_ids[{i}]"


def m_unknown_req_id(rng: random.Random, f: Fields) -> str:
    i = rng.choice([0, 1])
    f["req_ids"][i] = rng.choice(["ghost", "", "r2", "n1", "R0"])  # type: ignore[index]
    return f"req_ids[{i}]"


def m_reused_running_id(rng: random.Random, f: Fields) -> str:
    f["new_requests"] = [new_request(rng.choice(["r0", "r1"]))]
    for name in ARRAYS[:2]:
        f[name] = f[name][:2]  # type: ignore[index]
    f["req_ids"] = ["r0", "r1"]
    return "new_requests[0].req_id"


def m_duplicate_new(rng: random.Random, f: Fields) -> str:
    f["new_requests"] = [new_request("n0"), new_request("n0", temperature=rng.random())]
    return "new_requests[1].req_id"


def m_duplicate_release(rng: random.Random, f: Fields) -> str:
    name = rng.choice(["finished_req_ids", "aborted_req_ids"])
    f[name] = ["x", "y", "x"]
    return f"{name}[2]"


def m_bad_count(rng: random.Random, f: Fields) -> str:
    i = rng.randrange(3)
    counts = f["num_scheduled_tokens"]
    if rng.random() < 0.5:
        counts[i] = rng.randint(-(2**31), 0)  # type: ignore[index]
    else:
        counts[i] += rng.randint(1, 2**20)  # type: ignore[index, operator]
    return f"num_scheduled_tokens[{i}]"


def m_drafts_in_prefill(rng: random.Random, f: Fields) -> str:
    with_widths(f, 2, rng.randint(1, K))
    f["num_scheduled_tokens"][2] = rng.randint(1, 4) + f["num_draft_tokens"][2]  # type: ignore[index]
    return "num_draft_tokens[2]"


def structured(f: Fields) -> None:
    f.update(
        structured_req_ids=["r0"],
        cu_bitmask_rows=np.array([0, K + 1], np.int32),
        grammar_bitmask=np.full((K + 1, WORDS), -1, np.int32),
    )


def m_bitmask(rng: random.Random, f: Fields) -> str:
    structured(f)
    if rng.random() < 0.2:
        f["structured_req_ids"] = []  # a bitmask nobody owns must still be a bitmask
    shape = (K + 1, WORDS)
    f["grammar_bitmask"] = rng.choice(
        [
            np.full(shape, -1, np.float32),
            np.full(shape, 1, np.float16),
            np.ones(shape, np.bool_),
            np.full(shape, -1, np.int64),
            np.full((K + 1, WORDS + rng.choice([-1, 1])), -1, np.int32),
            np.full((K + 1) * WORDS, -1, np.int32),
            np.full((1, K + 1, WORDS), -1, np.int32),
        ]
    )
    return "grammar_bitmask"


def m_bitmask_missing(rng: random.Random, f: Fields) -> str:
    structured(f)
    name = rng.choice(["grammar_bitmask", "cu_bitmask_rows"])
    f[name] = None
    return name


def m_cu_rows(rng: random.Random, f: Fields) -> str:
    structured(f)
    f["cu_bitmask_rows"] = rng.choice(
        [
            np.array([0, K + 1], np.float32),
            np.array([0], np.int32),
            np.array([0, 1, K + 1], np.int32),
            np.array([1, K + 1], np.int32),
            np.array([0, K + 2], np.int32),
            np.array([[0, K + 1]], np.int32),
        ]
    )
    return "cu_bitmask_rows"


def m_row_count(rng: random.Random, f: Fields) -> str:
    structured(f)
    f["cu_bitmask_rows"] = np.array([0, rng.randint(0, K)], np.int32)
    return "cu_bitmask_rows[1]"


def m_deferred_ids(rng: random.Random, f: Fields) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        f["deferred_req_ids"] = [rng.choice(["ghost", "n1", ""])]
        return "deferred_req_ids[0]"
    if kind == 1:
        structured(f)
        f["deferred_req_ids"] = ["r0"]
        return "deferred_req_ids[0]"
    f["deferred_req_ids"] = ["r0", "r1", "r0"]
    return "deferred_req_ids[2]"


STEP_MUTATIONS: list[Mutation] = [
    m_negative_width,
    m_too_wide,
    m_placeholder_never_proposed,
    m_length,
    m_dtype,
    m_rank,
    m_draft_out_of_vocab,
    m_duplicate_req_id,
    m_unknown_req_id,
    m_reused_running_id,
    m_duplicate_new,
    m_duplicate_release,
    m_bad_count,
    m_drafts_in_prefill,
    m_bitmask,
    m_bitmask_missing,
    m_cu_rows,
    m_row_count,
    m_deferred_ids,
]


def bad_new_request(rng: random.Random) -> tuple[NewRequest, str]:
    """n0 with one wrong field: refused on its own (the rest of its step runs)."""
    kind = rng.randrange(6)
    where = "new_requests[0]."
    if kind == 0:
        shape = rng.choice([(2, 3), (1, 5), (5, 1), (2, 2, 2)])
        ids = np.full(shape, 7, rng.choice([np.int32, np.int64]))
        return new_request("n0", ids), where + "prompt_token_ids"
    if kind == 1:
        ids = np.array(PROMPTS["n0"], rng.choice([np.float32, np.float16, np.bool_]))
        return new_request("n0", ids), where + "prompt_token_ids"
    if kind == 2:
        bad = rng.choice([VOCAB, VOCAB + 999, 2**31 - 1, -1, -(2**31)])
        ids = np.array([5, bad, 6], np.int32)
        if rng.random() < 0.5:
            ids = rng.choice(
                [np.zeros(0, np.int32), np.full(MAX_LEN + rng.randint(0, 9), 5, np.int32)]
            )
        return new_request("n0", ids), where + "prompt_token_ids"
    if kind == 3:
        req = NewRequest("n0", np.array(PROMPTS["n0"], np.int32), SamplingParams(), 0)
        spec = rng.choice([-1, -(2**40), K + 1, 2**40])
        return NewRequest(req.req_id, req.prompt_token_ids, req.sampling, spec), (
            where + "num_speculative_tokens"
        )
    name, value = rng.choice(
        [
            ("temperature", float("nan")),
            ("temperature", float("inf")),
            ("temperature", -rng.random() - 1e-3),
            ("top_p", 0.0),
            ("top_p", 1.5),
            ("top_p", float("nan")),
            ("top_p", -1.0),
            ("top_k", -1),
            ("top_k", 2**31),
            ("top_k", 2**63 - 1),
        ]
    )
    return new_request("n0", **{name: value}), f"{where}sampling.{name}"


def refused(got: list[object], step_id: int, field: str) -> WorkerError:
    errors = [m for m in got if isinstance(m, WorkerError) and m.step_id == step_id]
    assert len(errors) == 1, f"step {step_id}: expected one error naming {field}, got {got}"
    err = errors[0]
    assert not err.fatal and err.field == field, f"step {step_id}: wanted {field}, got {err}"
    return err


# -- the fuzz run ----------------------------------------------------------------------------------


def start_running(s: Session) -> dict[str, int]:
    """r0 and r1 prefilled in one step; returns the drafts each was proposed."""
    sid = next(s.ids())
    s.chan.send(
        step(
            sid,
            new_requests=[new_request("r0"), new_request("r1")],
            req_ids=["r0", "r1"],
            num_scheduled_tokens=np.array([len(PROMPTS["r0"]), len(PROMPTS["r1"])], np.int32),
            num_draft_tokens=np.zeros(2, np.int32),
        )
    )
    out = recv(s.chan)
    assert isinstance(out, ModelRunnerOutput) and out.num_sampled.tolist() == [1, 1], out
    drafts = recv(s.chan)
    assert isinstance(drafts, DraftTokenIds)
    return dict(zip(drafts.req_ids, drafts.num_draft_tokens.tolist(), strict=True))


def deferred_round(rng: random.Random, s: Session, ids: Iterator[int], seq: int) -> bool:
    """A valid step that defers r0's rows, then wrong rows (after some traffic during the wait:
    stale rows, pings, a queued bad step, or a handshake). Returns whether it shook hands again
    (the worker then numbers steps afresh)."""
    sid = next(ids)
    f = base()
    f["deferred_req_ids"] = ["r0"]
    s.chan.send(step(sid, **f))
    expect: list[tuple[int, str]] = []
    if rng.random() < 0.3:  # rows of an earlier step: answered as late, the wait goes on
        stale = rng.randint(0, sid - 1)
        s.chan.send(rows(stale, ["r0"], [0]))
        expect.append((stale, "StepBitmask.step_id"))
    if rng.random() < 0.2:
        s.chan.send(Ping(seq=-seq))  # answered during the wait
    if rng.random() < 0.1:  # a handshake ends the wait: the step is refused, then the hello served
        s.chan.send(
            SchedulerHello(protocol_major=PROTOCOL_MAJOR, protocol_minor=2, scheduler_id="again")
        )
        expect.append((sid, "deferred_req_ids"))
        got = until_pong(s.chan, seq)
        assert any(isinstance(m, WorkerReady) for m in got), got
        for step_id, field in expect:
            refused(got, step_id, field)
        return True
    queued = None
    if rng.random() < 0.3:  # the next step, sent during the wait: handled after this one
        queued = next(ids)
        g = base()
        field = rng.choice(STEP_MUTATIONS)(rng, g)
        s.chan.send(step(queued, **g))
        expect.append((queued, field))
    v = rng.randint(0, K)
    kind = rng.randrange(6)
    if kind == 0:
        bad, field = rows(sid, ["r1"], [v]), "StepBitmask.req_ids"
    elif kind == 1:
        bad = rows(sid, ["r0"], [v], dtype=rng.choice([np.float32, np.int64, np.bool_]))
        field = "StepBitmask.grammar_bitmask"
    elif kind == 2:
        bad = rows(sid, ["r0"], [v], words=WORDS + rng.choice([-1, 1]))
        field = "StepBitmask.grammar_bitmask"
    elif kind == 3:
        good = rows(sid, ["r0"], [v])
        bad = StepBitmask(
            sid, ["r0"], good.num_valid_drafts.astype(np.float32), good.cu_bitmask_rows,
            good.grammar_bitmask,
        )  # fmt: skip
        field = "StepBitmask.num_valid_drafts"
    elif kind == 4:
        bad, field = rows(sid, ["r0"], [-rng.randint(1, 9)]), "StepBitmask.num_valid_drafts[0]"
    else:
        good = rows(sid, ["r0"], [v])
        cu = np.array([0, v + 1 + rng.choice([-1, 1])], np.int32)
        bad = StepBitmask(sid, ["r0"], good.num_valid_drafts, cu, good.grammar_bitmask)
        field = "StepBitmask.cu_bitmask_rows" if cu[1] > v + 1 else "StepBitmask.cu_bitmask_rows[1]"
    s.chan.send(bad)
    expect.append((sid, field))
    got = until_pong(s.chan, seq)
    for step_id, f_name in expect:
        refused(got, step_id, f_name)
    assert not any(isinstance(m, ModelRunnerOutput) for m in got), got
    return False


def rows(
    step_id: int,
    req_ids: list[str],
    valid: list[int],
    dtype: type = np.int32,
    words: int = WORDS,
) -> StepBitmask:
    n = sum(max(v, 0) + 1 for v in valid)
    cu = np.concatenate([[0], np.cumsum([max(v, 0) + 1 for v in valid])]).astype(np.int32)
    return StepBitmask(
        step_id, req_ids, np.array(valid, np.int32), cu, np.full((n, words), -1, dtype)
    )


# A message takes well under 0.1 s on a busy 2-core machine; the timeout is 10x that.
@pytest.mark.timeout(max(300, EXAMPLES))
def test_semantically_malformed_steps_are_refused_by_field(model_dir: Path, tmp_path: Path) -> None:
    print(f"semantic fuzz: {EXAMPLES} examples, seed {SEED} (SPECD_FUZZ_SEED to replay)")
    rng = random.Random(SEED)
    s = Session(model_dir, f"ipc://{tmp_path}/fuzzed.sock")
    try:
        start_running(s)
        ids = s.ids()
        last_executed: int | None = s.next_id
        counts: dict[str, int] = {}
        t0 = time.monotonic()
        for n in range(1, EXAMPLES + 1):
            kind = rng.random()
            if kind < 0.08:
                if deferred_round(rng, s, ids, n):
                    last_executed = None
                counts["deferred"] = counts.get("deferred", 0) + 1
            elif kind < 0.2:  # one bad new request: refused alone, its (empty) step runs
                sid = next(ids)
                req, field = bad_new_request(rng)
                n_sched = max(1, min(len(req.prompt_token_ids), MAX_LEN - 1))
                s.chan.send(
                    step(
                        sid,
                        new_requests=[req],
                        req_ids=["n0"],
                        num_scheduled_tokens=np.array([n_sched], np.int32),
                        num_draft_tokens=np.zeros(1, np.int32),
                    )
                )
                got = until_pong(s.chan, n)
                err = refused(got, sid, field)
                assert err.req_id == "n0"
                outs = [m for m in got if isinstance(m, ModelRunnerOutput)]
                assert len(outs) == 1 and outs[0].req_ids == [], got
                last_executed = sid
                counts["request"] = counts.get("request", 0) + 1
            elif kind < 0.25:  # a step id that does not follow the last executed step
                if last_executed is not None and rng.random() < 0.7:
                    sid = rng.randint(0, last_executed)
                else:
                    sid = -rng.randint(1, 2**40)
                s.chan.send(step(sid, **base()))
                refused(until_pong(s.chan, n), sid, "step_id")
                counts["order"] = counts.get("order", 0) + 1
            elif kind < 0.28:  # deferred rows with no step waiting for them
                stale = rng.randint(0, 2**40)
                s.chan.send(rows(stale, ["r0"], [rng.randint(0, K)]))
                refused(until_pong(s.chan, n), stale, "StepBitmask.step_id")
                counts["stray rows"] = counts.get("stray rows", 0) + 1
            else:
                sid = next(ids)
                f = base()
                mutate = rng.choice(STEP_MUTATIONS)
                field = mutate(rng, f)
                s.chan.send(step(sid, **f))
                got = until_pong(s.chan, n)
                refused(got, sid, field)
                assert not any(isinstance(m, ModelRunnerOutput) for m in got), (mutate, got)
                counts[mutate.__name__] = counts.get(mutate.__name__, 0) + 1
            if n % 100 == 0:
                assert s.proc.poll() is None, f"the worker exited after {n} messages"
        assert s.proc.poll() is None
        took = time.monotonic() - t0
        print(f"semantic fuzz: {EXAMPLES} messages in {took:.1f} s; kinds", sorted(counts.items()))
        # The running requests were never touched; fresh requests fit in every slot (none
        # leaked); greedy tokens equal a fresh worker's.
        s.hello()
        ids = s.ids()
        fuzzed = {
            "r0": greedy_run(s.chan, ids, "r0", 12, new=False),
            "n0": greedy_run(s.chan, ids, "n0", 12, new=True),
            "r1": greedy_run(s.chan, ids, "r1", 12, new=False),
        }
        s.chan.send(
            step(
                next(ids),
                new_requests=[new_request("x1"), new_request("x2")],
                finished_req_ids=["n0"],
            )
        )
        got = until_pong(s.chan, 0)
        assert not any(isinstance(m, WorkerError) for m in got), got
    finally:
        s.close()
    fresh_s = Session(model_dir, f"ipc://{tmp_path}/fresh.sock")
    try:
        ids = fresh_s.ids()
        first = {r: greedy_run(fresh_s.chan, ids, r, 1, new=True) for r in ("r0", "r1")}
        fresh = {
            "r0": first["r0"] + greedy_run(fresh_s.chan, ids, "r0", 11, new=False),
            "n0": greedy_run(fresh_s.chan, ids, "n0", 12, new=True),
            "r1": first["r1"] + greedy_run(fresh_s.chan, ids, "r1", 11, new=False),
        }
    finally:
        fresh_s.close()
    # r0 and r1 sampled their first token at start-up on the fuzzed worker
    assert {r: t[1:] for r, t in fresh.items() if r != "n0"} == {
        r: t[:11] for r, t in fuzzed.items() if r != "n0"
    }
    assert fresh["n0"] == fuzzed["n0"]
