"""The interface every drafter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from worker.host_copy import to_device
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates
from worker.sampling import probs_from_logits, sample_from


@dataclass
class Proposal:
    """Drafts for B requests: token_ids [B, K] on the device (entries past num_drafts[i] are junk),
    num_drafts (host list, B), and the draft distributions [B, K, V] when the drafter has them."""

    token_ids: torch.Tensor
    num_drafts: list[int]
    probs: torch.Tensor | None = None


class Drafter(ABC):
    """Proposes drafts after each step from the committed tokens in ``RequestStates``.

    ``propose`` gets the slots that sampled this step and each one's wanted width (its speculation
    length, already capped by the room left in the model length). ``remove`` is called when a
    request leaves.
    """

    name: str = "none"
    # True: the runner calls ``observe`` with the target's hidden states of committed positions
    needs_hidden_states: bool = False

    @abstractmethod
    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal: ...

    def bind(self, target: ModelExecutor) -> None:  # noqa: B027 - most drafters need nothing
        """Called once by the ``ModelRunner`` that owns the drafter, before any step, with the
        target's executor (state kept per target position pages through its block table)."""

    def remove(self, slot: int) -> None:  # noqa: B027 - most drafters keep no per-request state
        pass

    def observe(  # noqa: B027 - only drafters that read the target's hidden states
        self, rows: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """The target's hidden states [N, H] of a forward's N tokens, each at ``rows`` [N] (on
        the device): the flat KV-cache row where the token's keys went. Called right after the
        forward (a rejected draft's row is written too, and rewritten when its position runs
        again, as its keys are)."""

    def committed(  # noqa: B027 - only drafters that read the target's hidden states
        self, slots: np.ndarray, lengths: np.ndarray
    ) -> None:
        """After the step's commit: the first ``lengths[i]`` positions of ``slots[i]`` are
        committed, their hidden states given through ``observe``."""


def proposal_buffers(
    states: RequestStates,
    slots: list[int],
    widths: list[int],
    vocab_size: int,
    device: torch.device,
) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
    """What a model drafter's ``propose`` starts from: the indices of the requests with a
    width (``active``), the drafts [B, max(K, 1)] (zeros) and, when any active request samples,
    its draft distributions [B, max(K, 1), vocab_size] (zeros; else None)."""
    k = max(max(widths, default=0), 1)
    active = [i for i, w in enumerate(widths) if w > 0]
    out = torch.zeros((len(slots), k), dtype=torch.long, device=device)
    sampled = any(states.sampling[slots[i]].temperature > 0 for i in active)  # type: ignore[union-attr]
    probs = torch.zeros((len(slots), k, vocab_size), device=device) if sampled else None
    return active, out, probs


def choose_tokens(
    states: RequestStates, slots: list[int], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row of ``logits`` [N, V] (row i belongs to ``slots[i]``): the argmax for
    greedy requests, a sample from q (with the request's own generator) for the others; returns
    (tokens [N], q [N, V] or None when every row is greedy)."""
    picked = logits.argmax(-1)
    params = [states.sampling[s] for s in slots]
    if all(p.temperature == 0 for p in params):  # type: ignore[union-attr]
        return picked, None
    device = logits.device
    q = probs_from_logits(
        logits,
        to_device([max(p.temperature, 1e-5) for p in params], device, torch.float32),  # type: ignore[union-attr]
        to_device([p.top_k for p in params], device),  # type: ignore[union-attr]
        to_device([p.top_p for p in params], device, torch.float32),  # type: ignore[union-attr]
    )
    u = torch.stack(
        [torch.rand((), generator=p.generator, device=device) for p in params]  # type: ignore[union-attr]
    )
    greedy = to_device([p.temperature == 0 for p in params], device, torch.bool)  # type: ignore[union-attr]
    return torch.where(greedy, picked, sample_from(q, u)), q


class NoDrafter(Drafter):
    name = "none"

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        return Proposal(
            torch.zeros((len(slots), 1), dtype=torch.long, device=states.device), [0] * len(slots)
        )
