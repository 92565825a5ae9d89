"""``--chain-drafts``: prompt lookup's drafting steps left open (worker/chain.py). A step that
verifies or proposes drafts is verified, committed and proposed after on the device, the host
commits it as if every draft were accepted, and the step behind it is launched before its
accepted counts are read. Lossless like every other path: in process, steps interleaved as the
worker's loop does (arrivals and departures while a chained step is open, which close it first
or leave a slot behind), then through two real processes (CPU, float32, tiny models)."""

from __future__ import annotations

import numpy as np
import torch

from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
from tests.drafting import K
from tests.models import greedy_reference, reference_copy, tiny_model
from tests.test_pipeline_steps import Overlapped
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner

MAX_LEN = 128
MAX_TOKENS = 40


def chain_runner(
    seed: int, chain: bool, device: str = "cpu", graphs: bool = True
) -> tuple[ModelRunner, torch.nn.Module]:
    target = tiny_model("llama", seed)
    ref = reference_copy(target).eval()
    runner = ModelRunner(
        ModelExecutor(
            target.to(torch.device(device)),
            max_num_seqs=3,
            max_model_len=MAX_LEN,
            decode_width=1 + K,
            cuda_graphs=graphs,
        ),
        NgramDrafter(min_n=1, max_n=3, max_num_tokens=K),
        max_num_seqs=3,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=K,
        chain_drafts=chain,
    )
    return runner, ref


class Chained(Overlapped):
    """``Overlapped`` with the worker loop's rule for chained steps: a step that may not be
    chained is launched only once the open chained step is answered."""

    def __init__(self, r: ModelRunner) -> None:
        super().__init__(r)
        self.chained = 0
        self.closed_first = 0

    def step(self, s: SchedulerOutput) -> None:
        if self.open is not None and self.open.bounds and not self.r.may_chain(s):
            self.closed_first += 1
            self.drain()
        launched = self.r.launch(s, hold=True)
        self.chained += launched.chained
        if self.open is not None:
            self.pipelined += 1
            self.take(self.open)
        self.open = launched if launched.open else None
        if not launched.open:
            self.take(launched)


def decode_step(step_id: int, running: list[str], finished: list[str] = ()) -> SchedulerOutput:  # type: ignore[assignment]
    """Every running request decodes with K placeholder drafts, a cap (overlap scheduling)."""
    n = len(running)
    return SchedulerOutput(
        step_id=step_id,
        new_requests=[],
        req_ids=list(running),
        num_scheduled_tokens=np.full(n, 1 + K, np.int32),
        num_draft_tokens=np.full(n, K, np.int32),
        draft_token_ids=np.full(n * K, -1, np.int32),
        finished_req_ids=list(finished),
        aborted_req_ids=[],
        structured_req_ids=[],
        draft_widths_are_caps=True,
    )


def prefill_step(
    step_id: int, req_id: str, prompt: list[int], running: list[str]
) -> SchedulerOutput:
    """``req_id`` arrives (its whole prompt) beside the running requests' decodes."""
    base = decode_step(step_id, running)
    n = len(running)
    return SchedulerOutput(
        step_id=step_id,
        new_requests=[
            NewRequest(req_id, np.array(prompt, np.int32), SamplingParams(max_tokens=MAX_TOKENS), K)
        ],
        req_ids=[*running, req_id],
        num_scheduled_tokens=np.array([1 + K] * n + [len(prompt)], np.int32),
        num_draft_tokens=np.array([K] * n + [0], np.int32),
        draft_token_ids=base.draft_token_ids,
        finished_req_ids=[],
        aborted_req_ids=[],
        structured_req_ids=[],
        draft_widths_are_caps=True,
    )


PROMPTS = {
    "a": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],
    "b": [9, 3, 9, 3, 9, 3, 1, 2],
    "c": [4, 4, 2, 4, 4, 2, 4, 4, 2, 4, 4, 2, 11, 12],
}


def drive(r: ModelRunner) -> Chained:
    """a arrives, then b; both decode with drafts; c arrives while they run; a leaves once it has
    its tokens (read back a step late, as the scheduler sees them), its slot left to nobody."""
    drv = Chained(r)
    running: list[str] = []
    step = 0
    for req_id, at in (("a", 0), ("b", 3), ("c", 12)):
        while step < at:
            drv.step(decode_step(step, running))
            step += 1
        drv.step(prefill_step(step, req_id, PROMPTS[req_id], running))
        running.append(req_id)
        step += 1
    finished: list[str] = []
    while running:
        done = [q for q in running if len(drv.out.get(q, [])) >= MAX_TOKENS]
        running = [q for q in running if q not in done]
        finished = done
        if running or finished:
            drv.step(decode_step(step, running, finished))
        step += 1
    drv.drain()
    return drv


def check_chained(device: str, graphs: bool = True) -> None:
    r, ref = chain_runner(5, True, device, graphs)
    drv = drive(r)
    for req_id, prompt in PROMPTS.items():
        assert drv.out[req_id][:MAX_TOKENS] == greedy_reference(ref, prompt, MAX_TOKENS), req_id
    assert drv.chained > 20, drv.chained
    assert drv.closed_first >= 2  # the arrivals of b and c closed an open chained step
    # drafts were verified on the chained path
    assert sum(map(sum, drv.verified)) > 0


def test_chained_drafting_steps_greedy_equals_target_greedy() -> None:
    check_chained("cpu")


def test_chained_steps_equal_closed_steps() -> None:
    """The same schedule without --chain-drafts: the same tokens, and every KV block back once
    the requests have left (a chained step's upper-bound blocks are given back when it is read)."""
    runs = [(r, drive(r)) for r, _ in (chain_runner(5, chain) for chain in (False, True))]
    (r0, d0), (r1, d1) = runs
    assert d0.chained == 0 and d1.chained > 0
    for req_id in PROMPTS:
        assert d0.out[req_id][:MAX_TOKENS] == d1.out[req_id][:MAX_TOKENS], req_id
    for r in (r0, r1):
        blocks = r.target.kv_cache.blocks
        assert blocks.num_free == blocks.num_blocks and not r.states.slot_of


def step_of(
    step_id: int,
    counts: dict[str, int],
    widths: dict[str, int] | None = None,
    new: list[NewRequest] = (),  # type: ignore[assignment]
    cap: int = -1,
    finished: list[str] = (),  # type: ignore[assignment]
) -> SchedulerOutput:
    """A step of ``counts`` tokens a request, ``widths`` of them placeholder drafts (caps)."""
    ids = list(counts)
    w = np.array([(widths or {}).get(q, 0) for q in ids], np.int32)
    return SchedulerOutput(
        step_id=step_id,
        new_requests=list(new),
        req_ids=ids,
        num_scheduled_tokens=np.array([counts[q] for q in ids], np.int32),
        num_draft_tokens=w,
        draft_token_ids=np.full(int(w.sum()), -1, np.int32),
        finished_req_ids=list(finished),
        aborted_req_ids=[],
        structured_req_ids=[],
        draft_widths_are_caps=True,
        max_draft_proposals=cap,
    )


def both_ways(schedule: list[SchedulerOutput]) -> list[Chained]:
    """``schedule`` closed, then chained."""
    runs = []
    for chain in (False, True):
        drv = Chained(chain_runner(5, chain)[0])
        for s in schedule:
            drv.step(s)
        drv.drain()
        runs.append(drv)
    assert runs[1].chained > 0
    return runs


def test_a_prompt_ended_by_a_one_token_chunk_is_chained_from_its_prompt() -> None:
    """The last prompt token run alone (the scheduler's shape for a one-token last chunk) is a
    decode to ``may_chain``: the prompt reached the mirror when the request arrived. Its slot's
    last request filled the context (a stale row would put the step past the end)."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    long = [7, 9, 11] * 41 + [3, 4]  # 125 tokens, 128 once it has its three
    x = NewRequest("x", np.array(long, np.int32), SamplingParams(max_tokens=3), 0)
    a = NewRequest("a", np.array(prompt, np.int32), SamplingParams(max_tokens=8), K)
    schedule = [step_of(0, {"x": len(long)}, new=[x])]
    schedule += [step_of(i, {"x": 1}) for i in (1, 2, 3)]
    schedule.append(step_of(4, {"a": len(prompt) - 1}, new=[a], finished=["x"]))
    schedule.append(step_of(5, {"a": 1}))
    schedule += [step_of(i, {"a": 1 + K}, {"a": K}) for i in range(6, 14)]
    closed, chained = both_ways(schedule)
    ref = reference_copy(tiny_model("llama", 5)).eval()
    want = greedy_reference(ref, prompt, 8)
    assert closed.out["a"][:8] == chained.out["a"][:8] == want


def test_chained_drafts_are_the_closed_drafts() -> None:
    """Step by step, the drafts verified are those of the closed path: after a held step (the
    tuner's cap 0) answered behind a chained one, which must not clear the chained step's
    proposal; and near the request's end, where the proposal's room comes from the true length
    (not the upper bound the host holds while the step is open) and a stop id ends it."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 36, 86, 37, 36, 86, 37, 36, 86]
    for caps, max_tokens, stop in (
        ([0, 4, 4, 4], 40, ()),
        ([-1] * 8, 12, ()),
        ([-1] * 8, 40, (37,)),
    ):
        sampling = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop))
        new = NewRequest("a", np.array(prompt, np.int32), sampling, K)
        schedule = [step_of(0, {"a": len(prompt)}, new=[new], cap=caps[0])]
        schedule += [step_of(i, {"a": 1 + K}, {"a": K}, cap=c) for i, c in enumerate(caps[1:], 1)]
        closed, chained = both_ways(schedule)
        assert closed.verified == chained.verified, (caps, max_tokens, stop)
        assert closed.out == chained.out


def test_steps_without_drafts_are_held_unless_a_chained_step_is_open() -> None:
    """The tuner at zero width: a step that verifies and proposes nothing is held, as without
    --chain-drafts (the cheaper open step), except right behind a chained step, which it is
    chained behind rather than wait for."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    new = NewRequest("a", np.array(prompt, np.int32), SamplingParams(max_tokens=40), K)
    caps = [4, 4, 0, 0, 0, 0]
    drv = Chained(chain_runner(5, True)[0])
    drv.step(step_of(0, {"a": len(prompt)}, new=[new], cap=0))
    kinds = []
    for i, cap in enumerate(caps, 1):
        width = K if i > 1 and caps[i - 2] else 0  # the cap of the step before
        drv.step(step_of(i, {"a": 1 + width}, {"a": width}, cap=cap))
        kinds.append("chained" if drv.open.chained else "held")  # type: ignore[union-attr]
    drv.drain()
    # 1: proposes; 2: verifies and proposes; 3: verifies; 4: behind a chained step (and verifies
    # and proposes nothing: exact); 5, 6: held (5 behind that exact one)
    assert kinds == ["chained", "chained", "chained", "chained", "held", "held"], kinds
    ref = reference_copy(tiny_model("llama", 5)).eval()
    assert drv.out["a"] == greedy_reference(ref, prompt, len(drv.out["a"]))


def test_a_sample_of_the_chain_fuzz() -> None:
    """Twelve of ``make fuzz-chain``'s randomized schedules (tests/chain_fuzz.py): chained and
    closed alike, step by step, at every checkpoint and against target-only greedy."""
    from tests.chain_fuzz import run_schedule

    chained = 0
    for seed in range(12):
        res = run_schedule(seed)
        assert not res["findings"], (seed, res["findings"][:3])
        chained += res["stats"]["chained"]
    assert chained > 50
