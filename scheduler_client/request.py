"""A request as the scheduler sees it: the source of truth for its committed tokens."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from protocol.messages import SamplingParams
from scheduler_client.grammar import Matcher, StructuredSpec
from scheduler_client.metrics import RequestMetrics
from scheduler_client.stop_strings import StopStrings
from scheduler_client.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Mutable; owned by the scheduler. ``num_computed`` mirrors the worker's KV length."""

    req_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    num_speculative_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    structured: StructuredSpec | None = None
    matcher: Matcher | None = None
    detok: IncrementalDetokenizer | None = None
    stop_strings: StopStrings | None = None  # holds back text that may become a stop string
    on_delta: Callable[[Request, str], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    num_computed: int = 0
    sent_to_worker: bool = False
    # drafts for the next step: ids (-1 where the worker keeps them) after grammar validation
    draft_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # structured requests: the real ids of those drafts (validated), for the bitmask rows
    grammar_drafts: np.ndarray | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    num_judged: int = 0  # drafts the target judged (accepted ones + the first rejected)
    # the share of the drafts asked for that this request can verify (what the drafter proposed
    # and its grammar kept), a moving average (an n-gram lookup finds a match for some requests,
    # a model drafts for all); None until the first ask: the scheduler's pooled share over
    # recent requests like it stands in
    draft_hits: float | None = None
    # structured requests: where the grammar cut the last non-empty drafts validated (None
    # before any, after drafts it kept whole, and after a requeue). Overlap: the most of its
    # next drafts, not validated yet, that a step verifies
    grammar_kept: int | None = None
    # overlap scheduling: steps sent whose output has not arrived
    num_inflight: int = 0  # non-draft tokens they run
    pending_samples: int = 0  # how many of them sample this request
    inflight_max_new: int = 0  # the most tokens they can commit
    last_drafts: np.ndarray | None = None  # raw drafts proposed after the last output (or None)
    num_worker_losses: int = 0  # worker deaths while this request ran on it (2: not replayed)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.draft_ids = np.zeros(0, np.int32)
