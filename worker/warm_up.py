"""A few steps of two made-up requests before the worker reports ready.

CUDA graphs cover the target's decode steps (``capture_all``), but the first drafting step of a
served worker still ran code no step had run: the drafter's own forwards (an EAGLE head's catch-up
over a prompt and its one-token steps, a draft model's ragged catch-up), the verification of drafts,
sampling. On a GPU their first call compiles Triton kernels and plans cuBLAS calls, hundreds of
milliseconds that landed in one user's request (a TPOT p99 of 10 ms against a p50 of 2.4 ms). As the
in-process benchmarks do with an untimed pass, the worker now runs them once before it is ready:
a prefill of two prompts, steps that verify the drafts proposed at batch 2, then batch 1, then both
requests leave. The runner keeps nothing of them (their slots are freed as any finished request's).
The first request is structured, with rows that allow every token: the grammar bitmask's kernel
(one Triton launch, ``bitmask_kernel``) is compiled here, not in the first structured request's
step, and its drafts take the copy to the host that a grammar's drafts take.

Then the same at the full batch (``max_num_seqs`` made-up requests of ``FULL_PROMPT`` tokens, as
many as the step's token budget and the free KV blocks hold): served on an H100 (h100-s21), the
first steps at batch ~60 took 8-30 ms where later ones took 2.3-3 ms (none, n-gram, EAGLE, a draft
model, sync and overlap alike). What each first time pays is not isolated (host buffers that
grow with the batch, pinned staging among them, are candidates); the full batch runs it all
once: a prefill, a step verifying what the drafter proposed, one verifying ``k`` drafts given as
the scheduler gives grammar-forced ones (token 0: a step at full width whatever the drafter
found), and a plain step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocol.messages import DraftTokenIds, NewRequest, SamplingParams, SchedulerOutput
from worker.runner import ModelRunner

PROMPT_LENGTHS = (24, 9)  # two requests of different lengths, within any max_model_len used
STEPS = 3  # decode steps at batch 2, then as many at batch 1
FULL_PROMPT = 4  # tokens in each prompt of the full batch


def warm_up(runner: ModelRunner, k: int, vocab_size: int) -> int:
    """Runs the made-up requests through ``runner``; returns the steps run. ``k``: the drafts a
    request asks for (0: none). A step id never reaches a scheduler: ids restart at 0 after."""
    room = runner.states.max_model_len - 2 * STEPS * (k + 1) - 2
    budget = runner.target.max_num_tokens  # the most tokens a step may run (the scheduler's too)
    lengths = [min(n, room, budget // 2) for n in PROMPT_LENGTHS]
    if min(lengths) < 1 or runner.states.max_num_seqs < 2 or budget < 2 * (k + 1):
        return 0
    rng = np.random.default_rng(0)

    def made_up(ids: list[str], lengths: list[int], max_tokens: int) -> list[NewRequest]:
        """Random prompts of ``lengths``; the first request of the first phase is structured."""
        return [
            NewRequest(
                req_id=r,
                prompt_token_ids=rng.integers(0, vocab_size, n).astype(np.int32),
                sampling=SamplingParams(max_tokens=max_tokens),
                num_speculative_tokens=k,
                structured=r == "warm-up-0",
            )
            for r, n in zip(ids, lengths, strict=True)
        ]

    ids = [f"warm-up-{j}" for j in range(len(lengths))]
    new = made_up(ids, lengths, 2 * STEPS * (k + 1) + 1)
    words = (vocab_size + 31) // 32
    widths = dict.fromkeys(ids, 0)  # the drafts each request holds (the worker's own)
    step_id = 0

    def step(
        req_ids: list[str],
        counts: list[int],
        new_requests: Sequence[NewRequest] = (),
        finished: Sequence[str] = (),
        given: int | None = None,
    ) -> None:
        """``given``: each request verifies that many drafts of token 0 (as the scheduler sends
        grammar-forced ones; 0: a plain step); None: those the drafter proposed."""
        nonlocal step_id
        if given is not None:
            drafts = [given] * len(req_ids)
        else:
            drafts = [widths[r] if counts[j] == 1 else 0 for j, r in enumerate(req_ids)]
        # the structured request samples at every step it runs (its prompt whole, then one
        # token): 1 + its drafts rows, each allowing every token
        rows = 1 + drafts[0] if req_ids and req_ids[0] == ids[0] else 0
        sched = SchedulerOutput(
            step_id=step_id,
            new_requests=list(new_requests),
            req_ids=req_ids,
            num_scheduled_tokens=np.asarray(
                [c + d for c, d in zip(counts, drafts, strict=True)], np.int32
            ),
            num_draft_tokens=np.asarray(drafts, np.int32),
            draft_token_ids=np.full(sum(drafts), 0 if given else -1, np.int32),
            finished_req_ids=list(finished),
            aborted_req_ids=[],
            structured_req_ids=[ids[0]] if rows else [],
            cu_bitmask_rows=np.asarray([0, rows], np.int32) if rows else None,
            grammar_bitmask=np.full((rows, words), -1, np.int32) if rows else None,
        )
        step_id += 1
        runner.execute(sched)
        msg: DraftTokenIds | None = runner.take_draft_tokens()
        for r in req_ids:
            widths[r] = 0
        if msg is not None:
            for r, w in zip(msg.req_ids, msg.num_draft_tokens.tolist(), strict=True):
                widths[r] = w

    step(ids, lengths, new)  # the prompts, whole
    for _ in range(STEPS):
        step(ids, [1, 1])
    for j in range(STEPS):
        step(ids[:1], [1], (), ids[1:] if j == 0 else ())
    step([], [], (), ids[:1])

    # the full batch: as many requests as the budget and the free blocks hold (3 or more); each
    # fits max_model_len, which the first phase's 2 * STEPS * (k + 1) + 3 tokens already did
    blocks = runner.target.kv_cache.blocks
    full_len = FULL_PROMPT + 2 * (k + 1) + 2  # its prompt, then what three steps may add
    n = min(
        runner.states.max_num_seqs,
        budget // max(FULL_PROMPT, k + 1),
        blocks.num_free // int(blocks.blocks_for(full_len)),
    )
    if n > 2:
        full = [f"warm-up-full-{j}" for j in range(n)]
        widths.update(dict.fromkeys(full, 0))
        step(full, [FULL_PROMPT] * n, made_up(full, [FULL_PROMPT] * n, full_len))
        step(full, [1] * n)  # the drafter's own drafts, where it found any
        if k:
            step(full, [1] * n, given=k)
        step(full, [1] * n, given=0)
        step([], [], (), full)
    runner.num_steps = 0  # the steps a scheduler sees are counted from here
    return step_id
