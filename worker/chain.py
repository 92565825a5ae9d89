"""Drafting steps left open (``--chain-drafts``): the device's copy of every request's tokens.

Under ``--pipeline-steps`` a step that verifies drafts, or after which prompt lookup proposes, was
finished before the next step was laid out: the host read its accepted counts back, proposed, and
only then launched the step behind it, while the GPU waited. With ``--chain-drafts`` such a step
is left open as well when every request in it is a greedy, unconstrained decode on the decode
graphs' path (``ModelRunner.may_chain``). Its verification, the accepted tokens' place in each
request, and the next proposal (``ngram_lookup_device``) run on the device from this mirror, and
the host commits the step as if every draft were accepted (an upper bound). The step behind it
takes its positions and its first token from the mirror, and the host puts its own lengths right
when the open step's copy is read (``ModelRunner.read_output``).

The mirror holds what the host knows plus what open steps added on the device:
``length[slot]`` is the request's true committed length, ``tokens[slot, :length]`` its tokens.
``known[slot]`` (host) is how far the host has written it; a closed step's commit and a new
request's prompt are written from the host (``from_host``), an open step's tokens on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.drafters.ngram import ngram_lookup_device
from worker.host_copy import to_device
from worker.requests import RequestStates
from worker.step_batch import StepBatch, flat_ranges

# packed columns of an open drafting step's copy to the host, before its tokens
START, ACCEPTED, USED, FOUND = range(4)
HEAD = 4


class DeviceMirror:
    def __init__(self, states: RequestStates, width: int) -> None:
        self.states = states
        device = states.device
        n = states.max_num_seqs
        self.junk = n  # a row nobody reads: writes past a request's accepted tokens land there
        self.tokens = torch.zeros(
            (n + 1, states.max_model_len + width + 1), dtype=torch.long, device=device
        )
        self.length = torch.zeros(n + 1, dtype=torch.long, device=device)
        # the drafts the last proposal made for each slot (a verification accepts no more)
        self.found = torch.zeros(n + 1, dtype=torch.long, device=device)
        # where each request surely ends (``RequestStates.end_len``, ``end_ids``; -1: padding):
        # the proposal's room is the host's rule (``ModelRunner._draft_plan``) on true lengths
        self.end_len = torch.zeros(n + 1, dtype=torch.long, device=device)
        self.end_ids = torch.full((n + 1, 1), -1, dtype=torch.long, device=device)
        self.known = np.zeros(n, np.int64)

    def add(self, slots: list[int]) -> None:
        """New requests in ``slots``: their prompts, lengths and ends (nothing of a slot's last
        request is kept)."""
        st = self.states
        self.known[slots] = 0
        self.from_host(np.asarray(slots, np.int64))
        ends = [sorted(st.end_ids[s]) for s in slots]
        width = max(self.end_ids.shape[1], *map(len, ends))
        if width > self.end_ids.shape[1]:  # more stop ids than any request before
            wider = torch.full_like(self.end_ids[:, :1], -1).expand(-1, width).clone()
            wider[:, : self.end_ids.shape[1]] = self.end_ids
            self.end_ids = wider
        rows = np.full((len(slots), width), -1, np.int64)
        for j, ids in enumerate(ends):
            rows[j, : len(ids)] = ids
        both = to_device(
            np.concatenate([slots, st.end_len[slots], rows.ravel()]), self.tokens.device
        )
        b = len(slots)
        self.end_len[both[:b]] = both[b : 2 * b]
        self.end_ids[both[:b]] = both[2 * b :].view(b, width)

    def from_host(self, slots: np.ndarray) -> None:
        """The host's tokens of ``slots`` that the mirror lacks, and their lengths: one copy."""
        st = self.states
        slots = np.asarray(slots, np.int64)
        if not len(slots):
            return
        n = st.num_tokens[slots]
        if (self.known[slots] == n).all():
            return  # (the lengths are set wherever ``known`` is)
        known = np.minimum(self.known[slots], n)
        take = n - known
        pos = flat_ranges(known, take)
        rows = np.repeat(slots, take)
        width = self.tokens.shape[1]
        flat = to_device(
            np.concatenate([rows * width + pos, st.token_ids[rows, pos], slots, n]),
            self.tokens.device,
        )
        t = len(pos)
        self.tokens.view(-1)[flat[:t]] = flat[t : 2 * t]
        self.length[flat[2 * t : 2 * t + len(slots)]] = flat[2 * t + len(slots) :]
        self.known[slots] = n

    def held(self, slots: np.ndarray, positions: np.ndarray, sampled: torch.Tensor) -> None:
        """An open step without drafts: each slot's one sampled token (on the device) at its
        position (-1: past the context, not kept), known to the host by position only."""
        keep = positions >= 0
        slots, positions = slots[keep], positions[keep]
        if not len(slots):
            return
        idx = to_device(np.concatenate([np.flatnonzero(keep), slots, positions]), sampled.device)
        k = len(slots)
        self.tokens[idx[k : 2 * k], idx[2 * k :]] = sampled[idx[:k]].to(torch.long)
        self.length[idx[k : 2 * k]] = idx[2 * k :] + 1
        self.known[slots] = positions + 1

    def first_tokens(self, batch: StepBatch) -> torch.Tensor:
        """Each request's start position from the mirror (its length less one), with its first
        input token (its last committed one) written into ``batch.input_ids``: [B] on the
        device. The host's layout holds upper bounds where an open step is not read yet."""
        counts = np.asarray(batch.num_scheduled, np.int64)
        first = np.cumsum(counts) - counts
        both = to_device(np.concatenate([batch.slots, first]), self.tokens.device)
        slots = both[: len(first)]
        last = self.length[slots] - 1
        batch.input_ids[both[len(first) :]] = self.tokens[slots, last].to(batch.input_ids.dtype)
        return last

    def verify(self, logits: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """A chained step's greedy verification on the device (every request samples): each
        request accepts its drafts while they equal the argmax, and no more than the last
        proposal found; its accepted tokens and the bonus go into the mirror. Returns [B,
        HEAD + W + 1]: its length before the step, drafts accepted, drafts verified (the width
        run, less those the lookup did not find), 0 (``FOUND``, set by ``propose``), then its
        argmax row by row (past the accepted ones: junk)."""
        device = self.tokens.device
        widths = np.asarray(batch.num_drafts, np.int64)
        b, w = len(widths), int(widths.max(initial=0))
        cu = np.asarray(batch.cu_rows, np.int64)
        col = np.arange(w + 1)
        rows = cu[:-1, None] + np.minimum(col[None, :], widths[:, None])  # [B, W + 1]
        flat = to_device(np.concatenate([batch.slots, widths, rows.ravel()]), device)
        slots, width, rows_d = flat[:b], flat[b : 2 * b], flat[2 * b :].view(b, w + 1)
        argmax = logits.argmax(-1)[rows_d]  # [B, W + 1]
        cols = torch.arange(w + 1, device=device)[None, :]
        used = torch.minimum(width, self.found[slots])
        if w:
            drafts = batch.draft_token_ids[:, :w]
            match = (argmax[:, :w] == drafts) & (cols[:, :w] < used[:, None])
            accepted = match.to(torch.long).cumprod(1).sum(1)
        else:
            accepted = torch.zeros(b, dtype=torch.long, device=device)
        start = self.length[slots]
        kept = cols <= accepted[:, None]
        at_row = torch.where(kept, slots[:, None], self.junk)
        self.tokens[at_row, start[:, None] + cols] = argmax
        self.length[slots] = start + accepted + 1
        zero = torch.zeros_like(start)
        return torch.cat([torch.stack([start, accepted, used, zero], 1), argmax], 1)

    def propose(
        self,
        packed: torch.Tensor,
        slots: np.ndarray,
        widths: np.ndarray,
        columns: int,
        min_n: int,
        max_n: int,
        draft_token_ids: torch.Tensor,
    ) -> None:
        """Prompt lookup for ``slots`` at ``widths`` (host upper bounds) over the mirror's first
        ``columns`` positions (at least each request's length), on the device: the drafts go to
        ``draft_token_ids`` (``RequestStates.draft_token_ids``), their counts to ``found`` and to
        ``packed``'s ``FOUND`` column. Each count is held to the room the host's rule gives on
        the true length (``ModelRunner._draft_plan``): the context and the request's end left,
        and none after a stop or end-of-sequence token."""
        device = self.tokens.device
        b = len(slots)
        both = to_device(np.concatenate([slots, widths]), device)
        slots_d, widths_d = both[:b], both[b:]
        k = int(widths.max(initial=0))
        if not k:
            self.found[slots_d] = 0
            return
        length = self.length[slots_d]
        drafts, num = ngram_lookup_device(self.tokens[slots_d, :columns], length, min_n, max_n, k)
        room = torch.minimum(widths_d, self.states.max_model_len - length)
        room = torch.minimum(room, (self.end_len[slots_d] - length - 1).clamp(min=0))
        last = self.tokens[slots_d, (length - 1).clamp(min=0)]
        ended = (self.end_ids[slots_d] == last[:, None]).any(1)
        num = torch.where(ended, 0, torch.minimum(num, room))
        k = min(k, draft_token_ids.shape[1])
        draft_token_ids[slots_d, :k] = drafts[:, :k]
        self.found[slots_d] = num
        packed[:, FOUND] = num
