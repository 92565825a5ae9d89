"""Speculative-decoding metrics, per request and global."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """``num_drafts``: steps that verified at least one draft; ``num_draft_tokens``: drafts
    verified; ``accepted_per_position[i]``: steps whose draft i was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_grammar_invalid: int = 0  # drafts dropped because the grammar forbids them
    num_forced: int = 0  # grammar-forced drafts the scheduler offered
    num_stale: int = 0  # DraftTokenIds discarded for a wrong step or length
    num_output_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    start_s: float = field(default_factory=time.monotonic)  # the scheduler has it (prepared)
    end_s: float | None = None
    # monotonic: the engine loop took it in (before its preparation; None: added directly),
    # and its first step (admitted; a preempted request keeps its first)
    arrival_s: float | None = None
    scheduled_s: float | None = None

    def phases(self) -> dict[str, float]:
        """Seconds a finished request spent in each phase it reached: ``prep`` (limits, chat
        template, tokenizing, grammar), ``queue`` (waiting for admission), ``prefill`` (its
        first step to its first token) and ``decode`` (its first token to its end)."""
        out: dict[str, float] = {}
        if self.arrival_s is not None:
            out["prep"] = self.start_s - self.arrival_s
        if self.scheduled_s is not None:
            out["queue"] = self.scheduled_s - self.start_s
            if self.first_token_s is not None:
                out["prefill"] = self.first_token_s - self.scheduled_s
        if self.first_token_s is not None and self.end_s is not None:
            out["decode"] = self.end_s - self.first_token_s
        return out

    def record_step(self, num_draft_tokens: int, num_accepted: int, num_sampled: int) -> None:
        self.num_output_tokens += num_sampled
        if self.first_token_s is None and num_sampled:
            self.first_token_s = time.monotonic()
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: RequestMetrics) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted += other.num_accepted
        self.num_grammar_invalid += other.num_grammar_invalid
        self.num_forced += other.num_forced
        self.num_stale += other.num_stale
        self.num_output_tokens += other.num_output_tokens
        while len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position.append(0)
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verification step that carried drafts."""
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 1.0

    def summary(self, elapsed_s: float | None = None) -> dict[str, object]:
        out: dict[str, object] = {
            "output_tokens": self.num_output_tokens,
            "drafts": self.num_drafts,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
            "acceptance_per_position": [
                round(n / self.num_drafts, 3) if self.num_drafts else 0.0
                for n in self.accepted_per_position
            ],
            "grammar_invalid_drafts": self.num_grammar_invalid,
            "grammar_forced_drafts": self.num_forced,
            "stale_draft_messages": self.num_stale,
        }
        if elapsed_s:
            out["tokens_per_s"] = round(self.num_output_tokens / elapsed_s, 2)
        return out
