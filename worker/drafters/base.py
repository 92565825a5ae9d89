"""The interface every drafter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from worker.requests import RequestStates


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

    @abstractmethod
    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal: ...

    def remove(self, slot: int) -> None:  # noqa: B027 - most drafters keep no per-request state
        pass


class NoDrafter(Drafter):
    name = "none"

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        return Proposal(
            torch.zeros((len(slots), 1), dtype=torch.long, device=states.device), [0] * len(slots)
        )
