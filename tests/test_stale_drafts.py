"""Drafts that no longer fit fail closed: every way a ``DraftTokenIds`` can be stale (wrong step,
committed length off by one either way, a request that has finished, a request replayed after a
worker death) leaves the request with no drafts (width 0 next step), its grammar row at the
committed state (never allow-all), and the stale message counted. Overlap mode's valid-prefix cap
keeps a draft the scheduler never validated from being accepted.

A real ``Scheduler`` with the real llguidance grammar over the tiny byte-level tokenizer, fed
hand-built protocol messages; the cap test runs the worker's ``ModelRunner`` in-process."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from protocol.messages import (
    DraftTokenIds,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    StepBitmask,
)
from scheduler_client.grammar import GrammarBackend, StructuredSpec, make_backend
from scheduler_client.request import Request, Status
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.tokenizer import TokenizerInfo
from tests.models import (
    BYTE_MODEL_SEED,
    BYTE_VOCAB,
    EOS_ID,
    greedy_reference,
    reference_copy,
    tiny_model,
)
from worker.drafters.base import Drafter, Proposal
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates
from worker.runner import ModelRunner

K = 4
WORDS = (BYTE_VOCAB + 31) // 32
LIMITS = WorkerLimits(
    vocab_size=BYTE_VOCAB,
    eos_token_ids=(EOS_ID,),
    max_model_len=128,
    max_num_speculative_tokens=K,
    max_num_seqs=4,
)
LOWER = StructuredSpec("regex", "[a-z]{30}")  # any lowercase draft is valid


@pytest.fixture(scope="module")
def tok(target_dir: Path) -> TokenizerInfo:
    return TokenizerInfo(str(target_dir))


@pytest.fixture(scope="module")
def grammar(tok: TokenizerInfo) -> GrammarBackend:
    return make_backend("llguidance", tok.json_text, BYTE_VOCAB, (EOS_ID,))


def scheduler(tok: TokenizerInfo, grammar: GrammarBackend, *, overlap: bool = False) -> Scheduler:
    config = SchedulerConfig(adaptive_speculation=False, async_scheduling=overlap)
    return Scheduler(config, LIMITS, tok, grammar)


def request(
    tok: TokenizerInfo, req_id: str, spec: StructuredSpec | None, max_tokens: int = 20
) -> Request:
    return Request(
        req_id, tok.encode("ff"), SamplingParams(max_tokens=max_tokens), K, structured=spec
    )


def output(step_id: int, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    """Each request sampled ``tokens`` (no drafts verified)."""
    return ModelRunnerOutput(
        step_id=step_id,
        req_ids=list(sampled),
        num_sampled=np.array([len(t) for t in sampled.values()], np.int32),
        sampled_token_ids=np.array([t for ts in sampled.values() for t in ts], np.int32),
        num_draft_tokens=np.zeros(len(sampled), np.int32),
        num_accepted=np.array([len(t) - 1 for t in sampled.values()], np.int32),
    )


def drafts(step_id: int, per_req: dict[str, tuple[list[int], int]]) -> DraftTokenIds:
    """{req_id: (draft ids, committed length the drafts extend)}."""
    return DraftTokenIds(
        step_id=step_id,
        req_ids=list(per_req),
        num_draft_tokens=np.array([len(d) for d, _ in per_req.values()], np.int32),
        draft_token_ids=np.array([t for d, _ in per_req.values() for t in d], np.int32),
        num_committed_tokens=np.array([n for _, n in per_req.values()], np.int32),
    )


def committed_row(grammar: GrammarBackend, spec: StructuredSpec, tokens: list[int]) -> np.ndarray:
    """The grammar row [1, WORDS] after ``tokens``, from a fresh matcher."""
    m = grammar.matcher(spec)
    for t in tokens:
        assert m.accept(t)
    row = np.empty((1, WORDS), np.int32)
    m.fill_rows(row, 0, [])
    return row


def rows_of(out: SchedulerOutput, req_id: str) -> np.ndarray:
    k = out.structured_req_ids.index(req_id)
    assert out.cu_bitmask_rows is not None and out.grammar_bitmask is not None
    return out.grammar_bitmask[out.cu_bitmask_rows[k] : out.cu_bitmask_rows[k + 1]]


def width_of(out: SchedulerOutput, req_id: str) -> int:
    return int(out.num_draft_tokens[out.req_ids.index(req_id)])


def first_step(s: Scheduler, tok: TokenizerInfo) -> tuple[int, dict[str, int]]:
    """A structured request "s" and a plain one "p": prefill, one token each committed. Returns
    the step done and each request's committed length."""
    s.add(request(tok, "s", LOWER))
    s.add(request(tok, "p", None))
    s0 = s.schedule()
    assert s0 is not None and s0.req_ids == ["s", "p"]
    s.update(output(0, {"s": tok.encode("a"), "p": tok.encode("Z")}))
    return 0, {r: s.requests[r].num_tokens for r in ("s", "p")}


BCDE = "bcde"


def test_fresh_drafts_are_taken(tok: TokenizerInfo, grammar: GrammarBackend) -> None:
    """The control: drafts for the step just done, at the committed length, are verified next
    step, with one grammar row per draft position."""
    s = scheduler(tok, grammar)
    step, n = first_step(s, tok)
    s.take_drafts(drafts(step, {"s": (tok.encode(BCDE), n["s"]), "p": ([-1] * K, n["p"])}))
    out = s.schedule()
    assert out is not None
    assert width_of(out, "s") == K and width_of(out, "p") == K
    assert len(rows_of(out, "s")) == K + 1
    assert s.requests["s"].metrics.num_stale == 0


STALE = {
    "step-behind": (-1, 0),
    "step-ahead": (+1, 0),
    "length-short": (0, -1),
    "length-long": (0, +1),
}


@pytest.mark.parametrize("kind", list(STALE))
def test_stale_drafts_fail_closed(tok: TokenizerInfo, grammar: GrammarBackend, kind: str) -> None:
    ds, dn = STALE[kind]
    s = scheduler(tok, grammar)
    step, n = first_step(s, tok)
    s.take_drafts(
        drafts(step + ds, {"s": (tok.encode(BCDE), n["s"] + dn), "p": ([-1] * K, n["p"] + dn)})
    )
    for r in ("s", "p"):
        req = s.requests[r]
        assert len(req.draft_ids) == 0 and req.metrics.num_stale == 1, (r, req.draft_ids)
    out = s.schedule()
    assert out is not None
    assert width_of(out, "s") == 0 and width_of(out, "p") == 0
    assert len(out.draft_token_ids) == 0
    row = rows_of(out, "s")
    assert row.shape == (1, WORDS)
    assert not (row == -1).all(), "allow-all row for a structured request"
    np.testing.assert_array_equal(row, committed_row(grammar, LOWER, tok.encode("a")))


@pytest.mark.parametrize("kind", list(STALE))
def test_stale_drafts_in_overlap_mode_defer_zero_valid_drafts(
    tok: TokenizerInfo, grammar: GrammarBackend, kind: str
) -> None:
    """Overlap: the step after is already sent with placeholder widths; its deferred rows say 0
    valid drafts (the worker accepts none) and hold the committed grammar state."""
    ds, dn = STALE[kind]
    s = scheduler(tok, grammar, overlap=True)
    s.add(request(tok, "s", LOWER))
    s0, s1 = s.schedule(), s.schedule()
    assert s0 is not None and s1 is not None and s1.deferred_req_ids == ["s"]
    s.update(output(0, {"s": tok.encode("a")}))
    n = s.requests["s"].num_tokens
    fresh = s.deferred_bitmask(s1)  # before any drafts arrive: nothing validated
    assert fresh.num_valid_drafts.tolist() == [0]
    s.take_drafts(drafts(0 + ds, {"s": (tok.encode(BCDE), n + dn)}))
    assert s.requests["s"].metrics.num_stale == 1 and s.requests["s"].last_drafts is None
    rows = s.deferred_bitmask(s1)
    assert rows.num_valid_drafts.tolist() == [0] and rows.cu_bitmask_rows.tolist() == [0, 1]
    assert not (rows.grammar_bitmask == -1).all()
    np.testing.assert_array_equal(
        rows.grammar_bitmask, committed_row(grammar, LOWER, tok.encode("a"))
    )
    # the control: the same drafts, fresh, are all valid
    s.take_drafts(drafts(0, {"s": (tok.encode(BCDE), n)}))
    assert s.deferred_bitmask(s1).num_valid_drafts.tolist() == [K]


@pytest.mark.parametrize("how", ["abort", "length", "released"])
def test_drafts_for_a_finished_request_are_ignored(
    tok: TokenizerInfo, grammar: GrammarBackend, how: str
) -> None:
    """The worker proposes drafts for a request before it hears the request ended: they are
    ignored (no crash), and the request never comes back."""
    s = scheduler(tok, grammar)
    s.add(request(tok, "s", LOWER, max_tokens=1 if how == "length" else 20))
    s.add(request(tok, "p", None))
    assert s.schedule() is not None
    s.update(output(0, {"s": tok.encode("a"), "p": tok.encode("Z")}))
    n = s.requests["s"].num_tokens
    gone = s.requests["s"]
    if how != "length":
        s.abort("s")
    assert gone.finished
    if how == "released":
        s.release("s")
        assert "s" not in s.requests
    s.take_drafts(
        drafts(0, {"s": (tok.encode(BCDE), n), "p": ([-1] * 2, s.requests["p"].num_tokens)})
    )
    assert gone.finished and len(gone.draft_ids) == 0 and gone.metrics.num_stale == 0
    assert gone not in s.running and gone not in s.waiting
    assert len(s.requests["p"].draft_ids) == 2  # the live request's drafts are taken
    out = s.schedule()
    assert out is not None and out.req_ids == ["p"] and out.structured_req_ids == []
    assert out.aborted_req_ids + out.finished_req_ids == ["s"]
    s.update(output(1, {"p": tok.encode("YZX")}))
    s.take_drafts(drafts(1, {"s": (tok.encode(BCDE), n), "p": ([-1] * 2, n + 3)}))
    again = s.schedule()
    assert again is not None and again.req_ids == ["p"]
    assert not again.aborted_req_ids and not again.finished_req_ids
    assert gone.status is Status.FINISHED


def test_drafts_from_before_a_worker_death_are_not_replayed(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """Step 1 was in flight when the worker died; the engine requeues every request and marks
    step 1 done. Two messages of the dead worker must not feed the replay: its drafts after step
    0 (step id stale, length still matching, since step 1 committed nothing) and its drafts after
    step 1 (step id matching, length past what was committed)."""
    s = scheduler(tok, grammar)
    step, n = first_step(s, tok)
    before = drafts(step, {"s": (tok.encode(BCDE), n["s"]), "p": ([-1] * K, n["p"])})
    s.take_drafts(before)
    s1 = s.schedule()
    assert s1 is not None and width_of(s1, "s") == K  # sent; its output never arrives
    s.requeue_all()  # what Engine._recover does once the new worker shook hands
    assert s.last_done_step == 1
    after = drafts(1, {"s": (tok.encode("fghi"), n["s"] + 2), "p": ([-1] * K, n["p"] + 2)})
    for msg in (before, after):
        s.take_drafts(msg)
    for r in ("s", "p"):
        req = s.requests[r]
        assert len(req.draft_ids) == 0 and req.metrics.num_stale == 2, (r, req.draft_ids)
        assert req.grammar_drafts is None and req.last_drafts is None
    replay = s.schedule()
    assert replay is not None and [r.req_id for r in replay.new_requests] == ["s", "p"]
    assert replay.new_requests[0].prompt_token_ids.tolist() == tok.encode("ffa")
    assert replay.num_draft_tokens.tolist() == [0, 0] and len(replay.draft_token_ids) == 0
    np.testing.assert_array_equal(
        rows_of(replay, "s"), committed_row(grammar, LOWER, tok.encode("a"))
    )


class GreedyDrafter(Drafter):
    """Proposes the target's own greedy continuation of each request's committed tokens: the
    target would accept every draft unless a grammar row or a cap stops it."""

    name = "greedy"

    def __init__(self, ref: torch.nn.Module) -> None:
        self.ref = ref

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        out = torch.zeros((len(slots), K), dtype=torch.long)
        for j, (slot, w) in enumerate(zip(slots, widths, strict=True)):
            out[j, :w] = torch.tensor(greedy_reference(self.ref, states.tokens(slot).tolist(), w))
        return Proposal(out, list(widths))


# After the prompt "ff" the byte target's greedy text is "pBSBB" (asserted below). After "p" the
# grammar allows "B" or "S"; after "pB" only lowercase: the draft "S" at position 1 is invalid
# there, yet the row of position 0 (the committed state) allows it.
FORK = StructuredSpec("regex", "p(B[a-z]{0,8}|S[A-Z]{0,8})")


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "stale-length"])
def test_overlap_never_accepts_a_draft_past_the_valid_prefix(
    tok: TokenizerInfo, grammar: GrammarBackend, fresh: bool
) -> None:
    """Overlap mode, the worker verifying its own drafts "BSBB" (all the target's choice) against
    deferred rows. Fresh drafts: 1 valid ("B"), and "S" is refused by its row. Drafts the
    scheduler discarded (committed length off by one): 0 valid, and the worker's cap keeps it
    from accepting "B", "S", ... under the committed-state row that every position falls back to."""
    model = tiny_model("llama", BYTE_MODEL_SEED, vocab=BYTE_VOCAB)
    ref = reference_copy(model)
    prompt = tok.encode("ff")
    assert tok.decode(greedy_reference(ref, prompt, 5)) == "pBSBB"  # the premise
    runner = ModelRunner(
        ModelExecutor(model, max_num_seqs=2, max_model_len=64, decode_width=1 + K),
        GreedyDrafter(ref),
        max_num_seqs=2,
        max_model_len=64,
        max_num_draft_tokens=K,
    )
    s = scheduler(tok, grammar, overlap=True)
    req = s.add(Request("s", prompt, SamplingParams(max_tokens=6), K, structured=FORK))
    s0, s1 = s.schedule(), s.schedule()
    assert s0 is not None and s1 is not None and s1.deferred_req_ids == ["s"]
    out0, _ = runner.execute(s0)
    proposed = runner.take_draft_tokens()
    assert proposed is not None and tok.decode(proposed.draft_token_ids.tolist()) == "BSBB"
    s.update(out0)
    assert req.text == "p"
    if not fresh:
        proposed = msgspec.structs.replace(
            proposed, num_committed_tokens=proposed.num_committed_tokens + 1
        )
    s.take_drafts(proposed)
    sent = []

    def rows(step_id: int) -> StepBitmask:
        sent.append(s.deferred_bitmask(s1))
        return sent[-1]

    out1, rejected = runner.execute(s1, rows)
    assert not rejected
    valid = 1 if fresh else 0
    assert sent[0].num_valid_drafts.tolist() == [valid]
    assert int(out1.num_draft_tokens[0]) == K  # the worker verified all four
    assert int(out1.num_accepted[0]) == valid
    s.update(out1)
    assert req.error is None, req.error
    assert req.text[:2] == "pB" and len(req.text) == 2 + valid
    assert req.metrics.num_stale == (0 if fresh else 1)


def test_a_structured_requests_hit_rate_counts_the_drafts_its_grammar_keeps(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """The share of the drafts asked for that a request can verify is counted after its grammar:
    a drafter that ignores the grammar (a draft model's argmax) proposes drafts a structured
    request rejects, and counted as found, the tuner asked for them on every step while the next
    step verified none (45% of a served c=1 row's time, 1B and 135M dummies, sync, h100
    2026-12-06). A new request starts at the pooled share of requests like it: pooled with plain
    requests, each short structured one was asked on most of its steps (CPU, tiny dummies)."""
    s = scheduler(tok, grammar)
    step, n = first_step(s, tok)
    bad = tok.encode("BCDE")  # uppercase: "s" (lowercase only) keeps none of them
    s.take_drafts(drafts(step, {"s": (bad, n["s"]), "p": ([-1] * K, n["p"])}))
    assert s.requests["s"].draft_ids.size == 0
    assert s.requests["s"].draft_hits == pytest.approx(0.75)  # from 1.0, a quarter of the way
    assert s.requests["p"].draft_hits == 1.0
    # a new request starts at the pooled share of requests like it: structured ones kept none
    s.add(request(tok, "s2", LOWER))
    s.add(request(tok, "p2", None))
    assert s._hits(s.requests["s2"]) == 0.0 and s._hits(s.requests["p2"]) == 1.0
    out = s.schedule()
    assert out is not None and width_of(out, "s") == 0 and width_of(out, "p") == K
    s.update(output(1, {"s": tok.encode("b"), "p": tok.encode("Y")}))
    n = {r: s.requests[r].num_tokens for r in ("s", "p")}
    s.take_drafts(drafts(1, {"s": (tok.encode(BCDE), n["s"]), "p": ([-1] * K, n["p"])}))
    assert s.requests["s"].draft_hits == pytest.approx(0.75 + 0.25 * 0.25)  # all kept


def test_forced_tokens_do_not_count_as_drafts_the_request_can_verify(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """The grammar's forced tokens are offered as drafts whatever was asked, so they do not make
    asking pay: a drafter whose drafts the grammar rejects whole is counted as finding none, even
    where forced tokens fill the drafts' place."""
    forcing = StructuredSpec("regex", "abcdefgh[a-z]{20}")  # after "a": "bcdefgh" is forced
    s = scheduler(tok, grammar)
    s.add(request(tok, "f", forcing))
    s0 = s.schedule()
    assert s0 is not None
    s.update(output(0, {"f": tok.encode("a")}))
    n = s.requests["f"].num_tokens
    s.take_drafts(drafts(0, {"f": (tok.encode("BCDE"), n)}))
    assert s.requests["f"].draft_ids.size == K  # four forced tokens stand in the drafts' place
    assert s.requests["f"].metrics.num_forced == K
    assert s.requests["f"].draft_hits == pytest.approx(0.75)  # counted as finding none


@pytest.mark.parametrize("use_message", [True, False])
def test_a_drafter_held_at_zero_width_offers_no_forced_drafts(
    tok: TokenizerInfo, grammar: GrammarBackend, use_message: bool
) -> None:
    """After a step that asked the worker for no drafts (its tuner keeps drafting off), a
    structured request whose grammar forces its next tokens gets none as drafts: the step costs
    what it costs without a drafter, where no forced tokens are computed either (h200-s25: an
    EAGLE step at width zero cost 0.7 ms more than no drafter's at c=64, sync). A step that
    asked for drafts still gets them."""
    forcing = StructuredSpec("regex", "azzzzzzzzzzzz")
    for asked in (0, -1):
        s = scheduler(tok, grammar)
        s._proposals = lambda sampling, deferred, asked=asked: asked  # type: ignore[method-assign]
        s.add(request(tok, "s", forcing))
        s0 = s.schedule()
        assert s0 is not None and s0.max_draft_proposals == asked
        out = output(0, {"s": tok.encode("a")})
        s.update(out)
        if use_message:
            s.take_drafts(drafts(0, {"s": ([], s.requests["s"].num_tokens)}))
        else:
            s.no_drafts(msgspec.structs.replace(out, drafts_follow=False))
        nxt = s.schedule()
        assert nxt is not None
        forced = s.requests["s"].metrics.num_forced
        if asked == 0:
            assert width_of(nxt, "s") == 0 and forced == 0
        else:
            assert width_of(nxt, "s") == K and forced == K


@pytest.mark.parametrize("overlap", [False, True])
def test_no_drafts_leaves_what_a_message_of_zero_widths_leaves(
    tok: TokenizerInfo, grammar: GrammarBackend, overlap: bool
) -> None:
    """A worker of protocol minor 6 sends no ``DraftTokenIds`` after an output without drafts
    (``drafts_follow`` False). ``no_drafts`` must leave each request as the message of zero
    widths it replaces: a plain request, a structured one whose grammar forces its next tokens
    (the forced drafts come whatever was proposed), and a plain one of width 0; hit rates, the
    next step's widths, drafts and grammar rows alike."""
    forced = StructuredSpec("regex", "azzzzzzzzzzzz")
    runs = []
    for use_message in (True, False):
        s = scheduler(tok, grammar, overlap=overlap)
        s.add(request(tok, "s", forced))
        s.add(request(tok, "p", None))
        s.add(Request("p0", tok.encode("ff"), SamplingParams(max_tokens=20), 0))
        s0 = s.schedule()
        assert s0 is not None and s0.req_ids == ["s", "p", "p0"]
        out = output(0, {"s": tok.encode("a"), "p": tok.encode("Z"), "p0": tok.encode("Y")})
        s.update(out)
        if use_message:
            s.take_drafts(drafts(0, {r: ([], s.requests[r].num_tokens) for r in out.req_ids}))
        else:
            s.no_drafts(msgspec.structs.replace(out, drafts_follow=False))
        nxt = s.schedule()
        assert nxt is not None
        state = {
            r: (
                s.requests[r].draft_ids.tolist(),
                None
                if s.requests[r].grammar_drafts is None
                else s.requests[r].grammar_drafts.tolist(),
                s.requests[r].draft_hits,
            )
            for r in ("s", "p", "p0")
        }
        runs.append(
            (
                state,
                dict(s._hits_pool),
                nxt.req_ids,
                nxt.num_draft_tokens.tolist(),
                nxt.draft_token_ids.tolist(),
                None if nxt.grammar_bitmask is None else nxt.grammar_bitmask.tolist(),
            )
        )
    assert runs[0] == runs[1]
    state = runs[0][0]
    assert state["s"][0] and all(t >= 0 for t in state["s"][0])  # forced ids travel as real ids
    assert state["p"][0] == [] and state["p0"][0] == []


def test_overlap_verifies_no_more_unvalidated_drafts_than_the_grammar_kept_last(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """Overlap: a structured request is placed before its drafts are validated, with the
    worker's own drafts. Its width is at most what its grammar kept of the last drafts validated:
    a grammar-blind drafter's drafts that the grammar then cut were verified for nothing (a
    perfect dummy draft model: 912 draft tokens verified for 160 accepted in overlap, 148 for 148
    in sync). A plain request keeps its width; drafts all valid give the width back."""
    s = scheduler(tok, grammar, overlap=True)
    s.add(request(tok, "s", LOWER))
    s.add(request(tok, "p", None))
    s0, s1 = s.schedule(), s.schedule()
    assert s0 is not None and s1 is not None
    assert width_of(s1, "s") == K and width_of(s1, "p") == K  # nothing validated yet
    s.update(output(0, {"s": tok.encode("a"), "p": tok.encode("Z")}))
    n = {r: s.requests[r].num_tokens for r in ("s", "p")}
    s.take_drafts(drafts(0, {"s": (tok.encode("bcXY"), n["s"]), "p": ([-1] * K, n["p"])}))
    assert s.requests["s"].grammar_kept == 2
    s2 = s.schedule()
    assert s2 is not None and s2.deferred_req_ids == ["s"]
    assert width_of(s2, "s") == 2 and width_of(s2, "p") == K
    s.update(output(1, {"s": tok.encode("b"), "p": tok.encode("Z")}))
    n = {r: s.requests[r].num_tokens for r in ("s", "p")}
    s.take_drafts(drafts(1, {"s": (tok.encode(BCDE), n["s"]), "p": ([-1] * K, n["p"])}))
    assert s.requests["s"].grammar_kept is None  # kept whole: no limit
    s3 = s.schedule()
    assert s3 is not None and width_of(s3, "s") == K
    # fewer drafts than its width, all kept (the drafter found one, or the tuner asked for one):
    # the grammar cut nothing, so nothing limits the next step
    s.update(output(2, {"s": tok.encode("c"), "p": tok.encode("Z")}))
    n = {r: s.requests[r].num_tokens for r in ("s", "p")}
    s.take_drafts(drafts(2, {"s": (tok.encode("d"), n["s"]), "p": ([-1] * K, n["p"])}))
    assert s.requests["s"].grammar_kept is None
    s4 = s.schedule()
    assert s4 is not None and width_of(s4, "s") == K
    # a requeue (a worker restart's replay) forgets where the grammar cut
    s.take_drafts(drafts(2, {"s": (tok.encode("XY"), n["s"]), "p": ([-1] * K, n["p"])}))
    assert s.requests["s"].grammar_kept == 0
    s.requeue_all()
    assert s.requests["s"].grammar_kept is None


def test_the_tuner_counts_no_unvalidated_drafts_a_structured_request_cannot_verify(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """Overlap with the speculation tuner: a structured request whose grammar kept none of its
    last drafts verifies none of the next before they are validated, so the tuner's choice does
    not count it among the requests with drafts to verify (it would weigh a gain no request can
    take)."""
    config = SchedulerConfig(adaptive_speculation=True, async_scheduling=True)
    s = Scheduler(config, LIMITS, tok, grammar)
    s.add(request(tok, "s", LOWER))
    s0, s1 = s.schedule(), s.schedule()
    assert s0 is not None and s1 is not None
    s.update(output(0, {"s": tok.encode("a")}))
    n = s.requests["s"].num_tokens
    s.take_drafts(drafts(0, {"s": (tok.encode("XYZW"), n)}))  # none lowercase: none kept
    assert s.requests["s"].grammar_kept == 0
    s.proposal_caps[s1.step_id] = K  # as if the tuner had asked the worker for K after step 1
    s2 = s.schedule()
    assert s2 is not None and width_of(s2, "s") == 0
    assert s.choices[s2.step_id][:3] == (-1, 0, 1)  # no choice: no request with drafts to verify


def test_overlap_steps_with_deferred_grammar_rows_are_weighed_apart(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """Overlap with the speculation tuner: a step that carries a structured request whose last
    token is still being sampled has its grammar rows deferred, so the worker cannot leave it
    open. The tuner's choices for it, and its time, go to a bucket of their own; a plain
    request's steps and the first step of any request do not."""
    config = SchedulerConfig(adaptive_speculation=True, async_scheduling=True)
    s = Scheduler(config, LIMITS, tok, grammar)
    assert s.tuner is not None
    kinds: list[bool] = []
    propose = s.tuner.propose
    s.tuner.propose = lambda *a: kinds.append(a[3]) or propose(*a)  # type: ignore[method-assign]
    s.add(request(tok, "s", LOWER))
    s0, s1 = s.schedule(), s.schedule()
    assert s0 is not None and s1 is not None
    assert not s0.deferred_req_ids and s1.deferred_req_ids == ["s"]
    p = Scheduler(config, LIMITS, tok, grammar)
    assert p.tuner is not None
    propose_plain = p.tuner.propose
    p.tuner.propose = lambda *a: kinds.append(a[3]) or propose_plain(*a)  # type: ignore[method-assign]
    p.add(request(tok, "p", None))
    assert p.schedule() is not None and p.schedule() is not None
    assert kinds == [False, True, False, False]
    assert (1, True) in s.tuner._buckets and (
        1,
        False,
    ) in s.tuner._buckets  # both kinds of step proposed
    assert (1, True) not in p.tuner._buckets


def test_deferred_rows_are_built_once_their_requests_commit_before_the_others(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """Overlap: ``update(out, first, between)`` commits the next step's deferred requests first
    and runs ``between`` (the engine sends their rows there) before the others commit. The rows
    are those built after the whole update, and the finished requests come back in the output's
    order."""
    seen: list[tuple[int, int, np.ndarray]] = []
    rows = []
    for early in (False, True):
        s = scheduler(tok, grammar, overlap=True)
        s.add(request(tok, "p", None, max_tokens=1))
        s.add(request(tok, "s", LOWER, max_tokens=2))
        s.add(request(tok, "t", LOWER, max_tokens=2))
        s0, s1 = s.schedule(), s.schedule()
        assert s0 is not None and s1 is not None and s1.deferred_req_ids == ["s", "t"]
        before = {r: s.requests[r].num_tokens for r in ("p", "s")}
        out = output(0, {"p": tok.encode("Z"), "s": tok.encode("a"), "t": [EOS_ID]})

        def send(
            s: Scheduler = s, s1: SchedulerOutput = s1, before: dict[str, int] = before
        ) -> None:
            grown = {r: s.requests[r].num_tokens - n for r, n in before.items()}
            seen.append((grown["s"], grown["p"], s.deferred_bitmask(s1).grammar_bitmask))

        if early:
            done = s.update(out, {"s", "t"}, send)
            assert len(seen) == 1 and seen[0][:2] == (1, 0), "rows built after the others"
            rows.append(seen[0][2])
        else:
            done = s.update(out)
            rows.append(s.deferred_bitmask(s1).grammar_bitmask)
        assert [r.req_id for r in done] == ["p", "t"]
        assert all(s.requests[r].num_tokens == n + 1 for r, n in before.items())
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[1][:1], committed_row(grammar, LOWER, tok.encode("a")))
    assert (rows[1][1:] == -1).all(), "a request that ended gets an allow-all row"


def test_an_error_between_the_commits_is_raised_once_every_request_committed(
    tok: TokenizerInfo, grammar: GrammarBackend
) -> None:
    """A failure of ``between`` (building or sending the early rows) leaves no request of the
    output uncommitted: it is raised after them all."""
    s = scheduler(tok, grammar, overlap=True)
    s.add(request(tok, "p", None))
    s.add(request(tok, "s", LOWER))
    s0, s1 = s.schedule(), s.schedule()
    assert s0 is not None and s1 is not None and s1.deferred_req_ids == ["s"]
    before = {r: s.requests[r].num_tokens for r in ("p", "s")}

    def fail() -> None:
        raise RuntimeError("rows")

    with pytest.raises(RuntimeError, match="rows"):
        s.update(output(0, {"p": tok.encode("Z"), "s": tok.encode("a")}), {"s"}, fail)
    assert all(s.requests[r].num_tokens == n + 1 for r, n in before.items())
