"""Which requests of a step made it fail to travel.

A step that cannot be encoded here, or that the worker answers with an error naming no step (it
could not decode it), fails because of something one request carries. New requests are the only
part of a step built from user input (prompt ids, sampling values); the rest are arrays the
scheduler makes. Each new request is put alone in a step of its own and sent through an
encode-and-decode round trip with the wire codec: the ones that do not come back are to blame.
Only called after a failure, so the happy path pays nothing.
"""

from __future__ import annotations

import numpy as np

from protocol import Codec, ProtocolError
from protocol.messages import SchedulerOutput


def blame(sched: SchedulerOutput) -> list[str]:
    """Ids of ``sched``'s new requests that fail the wire round trip on their own (may be
    empty: then no single request is at fault)."""
    codec = Codec()
    culprits = []
    for new in sched.new_requests:
        alone = SchedulerOutput(
            step_id=sched.step_id,
            new_requests=[new],
            req_ids=[new.req_id],
            num_scheduled_tokens=np.ones(1, np.int32),
            num_draft_tokens=np.zeros(1, np.int32),
            draft_token_ids=np.zeros(0, np.int32),
            finished_req_ids=[],
            aborted_req_ids=[],
            structured_req_ids=[],
        )
        try:
            codec.decode(codec.encode(alone))
        except ProtocolError:
            culprits.append(new.req_id)
    return culprits
