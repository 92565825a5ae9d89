"""What a request must hold before the scheduler takes it: token ids inside the vocabulary (and so
inside the int32 arrays they travel in), sampling values of the types and widths the wire carries
(msgpack integers are at most 64 bits) and the ranges the worker accepts.

A request that fails here ends at once with the message, before anything of it is scheduled: a
value that cannot be encoded or decoded must never reach a ``SchedulerOutput``, where it would
fail the whole step (or be taken for a worker death).
"""

from __future__ import annotations

import math
from typing import Any

from scheduler_client.request import Request

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1
MAX_TOP_K = 2**31 - 1  # the worker's limit (a device int32)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def token_ids_problem(name: str, ids: Any, vocab_size: int) -> str | None:
    """``ids`` must be a list or tuple of ints in ``0..vocab_size - 1``."""
    if not isinstance(ids, list | tuple):
        return f"{name} must be a list of token ids, got {type(ids).__name__}"
    for i, t in enumerate(ids):
        if not _is_int(t):
            return f"{name}[{i}] must be an integer token id, got {type(t).__name__} {t!r:.40}"
        if not 0 <= t < vocab_size:
            return f"{name}[{i}] = {t} is outside the vocabulary (0..{vocab_size - 1})"
    return None


def request_problem(req: Request, vocab_size: int) -> str | None:
    """Why ``req`` cannot be sent to the worker, or None. Semantic limits that need the
    scheduler's state (prompt length, speculation width) are checked by ``Scheduler.add``."""
    if not isinstance(req.req_id, str) or not req.req_id:
        return "req_id must be a non-empty string"
    problem = token_ids_problem("prompt token ids", req.prompt_ids, vocab_size)
    if problem is not None:
        return problem
    s = req.sampling
    if not _is_number(s.temperature) or not math.isfinite(s.temperature) or s.temperature < 0:
        return f"temperature must be a finite number >= 0, got {s.temperature!r:.40}"
    if not _is_number(s.top_p) or not 0 < s.top_p <= 1:
        return f"top_p must be a number in (0, 1], got {s.top_p!r:.40}"
    if not _is_int(s.top_k) or not 0 <= s.top_k <= MAX_TOP_K:
        return f"top_k must be an integer in 0..{MAX_TOP_K} (0: off), got {s.top_k!r:.40}"
    if s.seed is not None and (not _is_int(s.seed) or not INT64_MIN <= s.seed <= UINT64_MAX):
        return f"seed must be an integer in {INT64_MIN}..{UINT64_MAX}, got {s.seed!r:.40}"
    if not _is_int(s.max_tokens) or not 1 <= s.max_tokens <= INT64_MAX:
        return f"max_tokens must be an integer in 1..{INT64_MAX}, got {s.max_tokens!r:.40}"
    problem = token_ids_problem("stop_token_ids", s.stop_token_ids, vocab_size)
    if problem is not None:
        return problem
    if not _is_int(req.num_speculative_tokens):
        return f"num_speculative_tokens must be an integer, got {req.num_speculative_tokens!r:.40}"
    if not all(isinstance(x, str) for x in req.stop):
        return "stop must be a list of strings"
    return None
