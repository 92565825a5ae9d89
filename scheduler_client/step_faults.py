"""A step the worker applied nothing of (it refused it, could not read it, or it never left):
what happens to the requests it carried. Called by the engine with the scheduler it owns."""

from __future__ import annotations

from protocol.messages import SchedulerOutput
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler


def refuse_step(
    sch: Scheduler, sched: SchedulerOutput, names: list[str], message: str, *, last: bool
) -> list[Request]:
    """The requests in ``names`` end with ``message``; the step's other new requests go back to
    the front of the queue (the worker kept none of them); its running ones run again next step.
    ``last``: no later step is in flight, so this one counts as the last done (the drafts of the
    steps before it are stale). Returns the requests it ended."""
    # NOTE: unsend before fail: a request the worker never took ends without an abort for it
    sch.unsend([r.req_id for r in sched.new_requests])
    for req_id in names:
        sch.fail(req_id, message)
    # the worker freed nothing the step named: name those again in the next one
    sch.to_free[:0] = [r for r in sched.finished_req_ids if r not in sch.to_free]
    sch.to_abort[:0] = [r for r in sched.aborted_req_ids if r not in sch.to_abort]
    sch.step_refused(sched)
    if last:
        sch.last_done_step = sched.step_id
    return [sch.requests[r] for r in names if r in sch.requests]
