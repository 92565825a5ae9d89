"""A separate, smaller causal LM as the drafter, with its own KV cache.

Per request the draft cache holds a valid prefix of the committed sequence. Each ``propose`` first
catches up (ragged forwards of at most the worker's token budget over every committed token the
draft has not seen, and always the last one, whose logits give the first draft), then runs k - 1
single-token steps. Drafts the target rejected are rolled back by comparing the remembered drafts
with the newly committed tokens: no coupling to the sampler.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.drafters.base import Drafter, Proposal, choose_tokens, proposal_buffers
from worker.drafters.catch_up import executor_forward, forward_in_chunks
from worker.host_copy import HostCopy, to_device
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates
from worker.step_batch import flat_ranges


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(
        self, executor: ModelExecutor, *, max_num_tokens: int, target_vocab_size: int | None = None
    ) -> None:
        self.executor = executor
        self.max_num_tokens = max_num_tokens
        # Draft distributions are over the target's vocabulary: a draft model with a smaller one
        # (real pairs differ by a few hundred ids) has probability 0 on the ids it lacks.
        self.vocab_size = target_vocab_size or executor.vocab_size
        assert self.vocab_size >= executor.vocab_size, "the draft's vocabulary is the larger"
        n = executor.kv_cache.max_num_seqs
        self.num_computed = np.zeros(n, np.int64)  # slot -> valid prefix in the draft cache
        self.fed_len = np.zeros(n, np.int64)  # slot -> committed length when drafts were fed
        self.fed = np.zeros((n, max(max_num_tokens, 1)), np.int64)  # drafts fed into the cache
        self.num_fed = np.zeros(n, np.int64)
        # the last proposal's drafts on their way to the host, and (slot, row, width) of each
        # request that fed some: written into ``fed`` when the next proposal starts
        self._pending: tuple[HostCopy, list[tuple[int, int, int]]] | None = None

    def remove(self, slot: int) -> None:
        self.num_computed[slot] = 0
        self.executor.kv_cache.free(slot)
        self.num_fed[slot] = 0

    def _settle_fed(self) -> None:
        """The fed drafts of the last proposal into ``fed``: their copy to the host was queued
        behind the draft's forwards, and by the next proposal the target's step has waited for
        those. (A slot freed since keeps num_fed 0, so what lands there is never read.)"""
        if self._pending is None:
            return
        copy, rows = self._pending
        self._pending = None
        fed = copy.read()
        for slot, i, w in rows:
            self.fed[slot, : w - 1] = fed[i, : w - 1]

    def _roll_back(self, states: RequestStates, slot: int) -> None:
        """Keep only the fed drafts that the target accepted."""
        if self.num_fed[slot] == 0:
            return
        base = int(self.fed_len[slot])
        committed = states.tokens(slot)[base : base + int(self.num_fed[slot])]
        fed = self.fed[slot, : len(committed)]
        keep = int(np.cumprod(fed == committed).sum()) if len(committed) else 0
        self.num_computed[slot] = min(int(self.num_computed[slot]), base + keep)
        self.num_fed[slot] = 0

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        ex = self.executor
        device = ex.device
        kmax = max(widths, default=0)
        active, out, probs = proposal_buffers(states, slots, widths, self.vocab_size, device)
        if not active:
            return Proposal(out, [0] * len(slots), probs)

        # Catch up: every committed token the draft cache lacks, for all active requests at once.
        self._settle_fed()
        ids: list[np.ndarray] = []
        starts, counts = [], []
        for i in active:
            slot = slots[i]
            self._roll_back(states, slot)
            tokens = states.tokens(slot)
            # The last committed token always runs: its logits give draft 0. Its keys may be in
            # the cache already (a bonus token equal to a fed draft the scheduler did not
            # verify); running it again rewrites the same values.
            start = min(int(self.num_computed[slot]), len(tokens) - 1)
            ids.append(tokens[start:])
            starts.append(start)
            counts.append(len(tokens) - start)
            self.fed_len[slot] = len(tokens)
        step_slots = [slots[i] for i in active]
        # A target id the draft's smaller vocabulary lacks (an added or special token) enters the
        # draft as id 0: its drafts may be worse there, never wrong (the target verifies them).
        ids_np = np.concatenate(ids).astype(np.int64)
        ids_np[ids_np >= ex.vocab_size] = 0
        input_ids = to_device(ids_np, device)
        positions = to_device(
            flat_ranges(starts, counts),
            device,
        )

        # [len(active), draft vocab]: each request's last committed token
        logits = forward_in_chunks(
            executor_forward(ex, input_ids, positions, step_slots),
            starts,
            counts,
            np.cumsum(counts) - 1,
            ex.max_num_tokens,
        )
        for slot in step_slots:
            self.num_computed[slot] = int(states.num_tokens[slot])

        for j in range(kmax):
            tokens = self._pick(states, [slots[i] for i in active], logits, active, j, out, probs)
            still = [n for n, i in enumerate(active) if widths[i] > j + 1]
            if not still:
                break
            active = [active[n] for n in still]
            step_slots = [slots[i] for i in active]
            starts = [int(self.num_computed[s]) for s in step_slots]
            for s in step_slots:
                self.num_computed[s] += 1
            logits, _ = ex.forward(
                # a list index would be copied to the device from pageable memory: a sync
                tokens if len(still) == len(tokens) else tokens[to_device(still, device)],
                to_device(starts, device),
                step_slots,
                starts,
                [1] * len(step_slots),
                torch.arange(len(step_slots), device=device),
            )
        # What was fed back (drafts 0 .. w-2), for the next proposal's roll-back; not read here:
        # a read now would make the host wait for the draft's k forwards.
        self._pending = (HostCopy(out), [(slots[i], i, w) for i, w in enumerate(widths) if w > 1])
        for i, w in enumerate(widths):
            self.num_fed[slots[i]] = max(w - 1, 0)
        return Proposal(out, list(widths), probs)

    def _pick(
        self,
        states: RequestStates,
        slots: list[int],
        logits: torch.Tensor,
        rows: list[int],
        j: int,
        out: torch.Tensor,
        probs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Choose draft j for each row: argmax for greedy requests, a sample from q otherwise."""
        picked, q = choose_tokens(states, slots, logits)
        idx = to_device(rows, logits.device)
        if probs is not None and q is not None:
            probs[idx, j, : q.shape[1]] = q  # [N, draft vocab] into [N, target vocab]
        out[idx, j] = picked
        return picked
