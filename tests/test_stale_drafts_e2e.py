"""Stale drafts through a real worker over ipc://: the worker's own ``DraftTokenIds``, made stale
on their way in (committed length off by one either way, a step behind), delivered for requests
that have just finished, and delivered late across a worker death and replay. Each is discarded
(width 0 next step, counted), and every output still equals an undisturbed run."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import msgspec

from protocol.messages import DraftTokenIds, SchedulerOutput
from tests.test_scheduler_e2e import engine

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
BATCH = [
    {"prompt": "phone", "max_tokens": 40, "structured": {"regex": PHONE}},
    {"prompt": list(b"abcabcabcabcabcabc"), "max_tokens": 40, "ignore_eos": True},
    {"prompt": list(b"x"), "max_tokens": 3, "ignore_eos": True},  # finishes first
]


def shifted(msg: DraftTokenIds, step: int, length: int) -> DraftTokenIds:
    return msgspec.structs.replace(
        msg, step_id=msg.step_id + step, num_committed_tokens=msg.num_committed_tokens + length
    )


def test_stale_drafts_from_a_real_worker_fail_closed(target_dir: Path, draft_dir: Path) -> None:
    # drafting every step: a step whose requests got no drafts sends no message (protocol
    # minor 6), and this test tampers with the messages
    with engine(target_dir, "draft_model", draft_dir, adaptive_speculation=False) as e:
        want = [r.output_ids for r in e.generate([dict(w) for w in BATCH])]
        sch = e.scheduler
        take, schedule = sch.take_drafts, sch.schedule
        tamper = [(0, +1), (0, -1), (-1, 0)]  # the first three messages, one way each
        taken: list[DraftTokenIds] = []
        stale_for: set[str] = set()  # live requests named by the last stale message
        finished_named = 0

        def take_drafts(msg: DraftTokenIds) -> None:
            nonlocal finished_named
            if tamper:
                msg = shifted(msg, *tamper.pop(0))
                stale_for.update(r for r in msg.req_ids if not sch.requests[r].finished)
            finished = [sch.requests[r] for r in msg.req_ids if sch.requests[r].finished]
            finished_named += len(finished)
            before = {r: sch.requests[r].metrics.num_stale for r in stale_for}
            take(msg)
            taken.append(msg)
            for r in finished:
                assert len(r.draft_ids) == 0 and r not in sch.running and r not in sch.waiting
            for r, n in before.items():
                assert sch.requests[r].metrics.num_stale == n + 1, r
                assert len(sch.requests[r].draft_ids) == 0, r

        def schedule_checked() -> SchedulerOutput | None:
            out = schedule()
            for r in list(stale_for):
                if out is not None and r in out.req_ids:
                    assert int(out.num_draft_tokens[out.req_ids.index(r)]) == 0, r
                    if r in out.structured_req_ids:
                        assert out.cu_bitmask_rows is not None and out.grammar_bitmask is not None
                        k = out.structured_req_ids.index(r)
                        rows = out.grammar_bitmask[
                            out.cu_bitmask_rows[k] : out.cu_bitmask_rows[k + 1]
                        ]
                        assert len(rows) == 1 and not (rows == -1).all(), r
            stale_for.clear()
            return out

        sch.take_drafts = take_drafts  # type: ignore[method-assign]
        sch.schedule = schedule_checked  # type: ignore[method-assign]
        reqs = [e.add_request(**w) for w in BATCH]
        while tamper or not reqs[2].finished:
            e.step()
        assert finished_named > 0, "no drafts arrived for a request that had just finished"
        e.step()
        assert not reqs[0].finished and not reqs[1].finished
        # The worker finishes step s + 1 (output and drafts read here, never committed), then dies.
        before_death = taken[-1]
        sched = schedule()
        assert sched is not None
        e.client.send_step(sched)
        e.in_flight.append(sched)
        lost = e.client.receive(sched).drafts
        assert lost is not None
        assert e.proc is not None
        os.kill(e.proc.pid, signal.SIGKILL)
        e.proc.wait(timeout=30)
        e.step()  # notices the death, relaunches, requeues every request
        assert e.num_worker_restarts == 1 and sch.last_done_step == sched.step_id
        live = {r.req_id for r in reqs if not r.finished}
        assert live <= set(before_death.req_ids) & set(lost.req_ids)
        # both messages of the dead worker arrive late; neither may feed the replay
        stale = {r: sch.requests[r].metrics.num_stale for r in live}
        for msg in (before_death, lost):
            take(msg)
        for r in live:
            assert sch.requests[r].metrics.num_stale == stale[r] + 2, r
            assert len(sch.requests[r].draft_ids) == 0, r
        stale_for.update(live)  # the replay step verifies no drafts
        e.run_until_done()
        assert [r.error for r in reqs] == [None] * len(reqs)
        assert re.fullmatch(PHONE, reqs[0].text), reqs[0].text
        assert [r.output_ids for r in reqs] == want
