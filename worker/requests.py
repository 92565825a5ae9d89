"""Persistent per-request state, indexed by slot; separate from the per-step batch.

A request keeps its slot from the step it arrives until it is finished or aborted. Token ids are
the committed sequence (prompt, then sampled tokens); ``num_computed`` counts the positions whose KV
is in the target's cache; ``draft_token_ids`` holds the drafts proposed after the last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from protocol.messages import NewRequest

MAX_TOP_K = 2**31 - 1  # larger values mean "no top-k" in practice, and overflow a device int


class WorkerRequestError(ValueError):
    """A request the worker cannot serve; ``req_id`` names it and the others keep running."""

    def __init__(self, req_id: str, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.code = code
        self.field = field


@dataclass
class SamplingState:
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


class RequestStates:
    """Who may call what: the runner adds, commits and removes; drafters read token ids."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_draft_tokens: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        self.slot_of: dict[str, int] = {}  # req_id -> slot
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)  # [slot, position]
        self.num_tokens = np.zeros(max_num_seqs, np.int64)  # committed length
        self.num_computed = np.zeros(max_num_seqs, np.int64)
        self.num_speculative = np.zeros(max_num_seqs, np.int64)  # per-request k (0: off)
        self.structured = np.zeros(max_num_seqs, bool)
        # where a request surely ends: its length at max_tokens (a replay's prompt holds its
        # output too, so this is at or past the real end), and the tokens that end it (its stop
        # ids and the model's end of sequence, which a request that ignores it runs past: it is
        # then proposed nothing once, and its output is the same)
        self.end_len = np.zeros(max_num_seqs, np.int64)
        self.end_ids: list[frozenset[int]] = [frozenset()] * max_num_seqs
        self.sampling: list[SamplingState | None] = [None] * max_num_seqs
        # [slot, max_num_draft_tokens] drafts proposed after the last step, on the device
        self.draft_token_ids = torch.zeros(
            (max_num_seqs, max(max_num_draft_tokens, 1)), dtype=torch.long, device=device
        )
        self.num_drafts = np.zeros(max_num_seqs, np.int64)
        # moves on each time a slot is taken or given back: a step left open names its slots
        # with it, so a token read back later never lands in a request that took the slot since
        self.generation = np.zeros(max_num_seqs, np.int64)

    def check_new(self, req: NewRequest, max_num_draft_tokens: int, where: str) -> None:
        """Refuse (``WorkerRequestError`` naming the field under ``where``, e.g.
        ``new_requests[0]``) a request the worker cannot serve; changes nothing. Whether its id is
        free and a slot is left is the step's to check (``worker.step_checks``)."""

        def refuse(code: str, field: str, message: str) -> WorkerRequestError:
            return WorkerRequestError(
                req.req_id, code, f"request {req.req_id!r}: {message}", field=f"{where}.{field}"
            )

        ids = req.prompt_token_ids
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            shape = getattr(ids, "shape", "?")
            dtype = getattr(ids, "dtype", type(ids).__name__)
            raise refuse(
                "bad_prompt",
                "prompt_token_ids",
                f"prompt_token_ids must be a 1-D integer array, got {dtype} {shape}",
            )
        n = len(ids)
        if n == 0:
            raise refuse("empty_prompt", "prompt_token_ids", "the prompt is empty")
        if n >= self.max_model_len:
            raise refuse(
                "prompt_too_long",
                "prompt_token_ids",
                f"prompt of {n} tokens does not fit max_model_len {self.max_model_len} "
                "(with room for one generated token)",
            )
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise refuse(
                "bad_token",
                "prompt_token_ids",
                f"prompt token ids must be in 0..{self.vocab_size - 1}, "
                f"got {int(ids.min())}..{int(ids.max())}",
            )
        if not 0 <= req.num_speculative_tokens <= max_num_draft_tokens:
            raise refuse(
                "bad_speculation",
                "num_speculative_tokens",
                f"num_speculative_tokens {req.num_speculative_tokens} is outside "
                f"0..{max_num_draft_tokens}",
            )
        s = req.sampling
        for name, ok in (
            ("temperature", math.isfinite(s.temperature) and s.temperature >= 0),
            ("top_p", 0 < s.top_p <= 1),
            ("top_k", 0 <= s.top_k <= MAX_TOP_K),
            ("seed", s.seed is None or -(2**63) <= s.seed < 2**64),
        ):
            if not ok:
                raise refuse(
                    "bad_sampling",
                    f"sampling.{name}",
                    "temperature must be finite and >= 0, top_p in (0, 1], "
                    f"top_k in 0..{MAX_TOP_K}; got {name} {getattr(s, name)!r}",
                )

    def add(self, req: NewRequest, max_num_draft_tokens: int) -> int:
        """Take a slot for a request that ``check_new`` and the step's checks passed."""
        if req.req_id in self.slot_of:
            raise WorkerRequestError(
                req.req_id, "duplicate_request", f"request {req.req_id!r} is already running"
            )
        self.check_new(req, max_num_draft_tokens, "new_request")
        if not self.free_slots:
            raise WorkerRequestError(
                req.req_id,
                "no_free_slot",
                f"request {req.req_id!r}: all {self.max_num_seqs} slots are busy (max_num_seqs)",
            )
        n = len(req.prompt_token_ids)
        s = req.sampling
        slot = self.free_slots.pop()
        self.slot_of[req.req_id] = slot
        self.generation[slot] += 1
        self.token_ids[slot, :n] = req.prompt_token_ids
        self.num_tokens[slot] = n
        self.num_computed[slot] = 0
        self.num_speculative[slot] = req.num_speculative_tokens
        self.structured[slot] = req.structured
        # (max_tokens may be up to 2**63; past the context its room decides)
        self.end_len[slot] = min(n + s.max_tokens, self.max_model_len + 1)
        self.end_ids[slot] = self.eos_token_ids.union(s.stop_token_ids)
        self.num_drafts[slot] = 0
        gen = None
        if s.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(s.seed)
        self.sampling[slot] = SamplingState(s.temperature, s.top_k, s.top_p, gen)
        return slot

    def remove(self, req_id: str) -> int | None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self.sampling[slot] = None
            self.num_drafts[slot] = 0
            self.generation[slot] += 1
            self.free_slots.append(slot)
        return slot

    def tokens(self, slot: int) -> np.ndarray:
        return self.token_ids[slot, : self.num_tokens[slot]]

    def append(self, slot: int, new_tokens: list[int]) -> None:
        n = int(self.num_tokens[slot])
        room = self.max_model_len - n
        new_tokens = new_tokens[:room]
        self.token_ids[slot, n : n + len(new_tokens)] = new_tokens
        self.num_tokens[slot] = n + len(new_tokens)
