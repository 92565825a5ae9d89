"""Parallel drafting with a mask token (PARD-style): one draft-model forward proposes k drafts.

The draft model is trained to predict several future tokens at once: after the committed sequence
it reads k - 1 mask tokens (the id from ``get_parallel_drafting_token_id`` on its config). The
logits at the last committed token give draft 1 and those at mask i give draft i + 1, so one
forward yields k drafts. The masks' keys land in the draft cache after the committed tokens and are
never kept: the cache's valid length stays the committed length, and the next forward overwrites
them. Greedy picks (argmax); for sampled requests the draft distributions travel with the drafts so
verification stays exact.
"""

from __future__ import annotations

import numpy as np

from worker.drafters.base import Drafter, Proposal, choose_tokens, proposal_buffers
from worker.drafters.catch_up import executor_forward, forward_in_chunks
from worker.host_copy import to_device
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates
from worker.spec_utils import get_parallel_drafting_token_id
from worker.step_batch import flat_ranges


class ParallelDrafter(Drafter):
    name = "parallel"

    def __init__(
        self, executor: ModelExecutor, *, max_num_tokens: int, target_vocab_size: int | None = None
    ) -> None:
        self.executor = executor
        self.max_num_tokens = max_num_tokens
        # Draft distributions are over the target's vocabulary: a draft model with a smaller one
        # (real pairs differ by a few hundred ids) has probability 0 on the ids it lacks.
        self.vocab_size = target_vocab_size or executor.vocab_size
        assert self.vocab_size >= executor.vocab_size, "the draft's vocabulary is the larger"
        self.mask_token_id = get_parallel_drafting_token_id(executor.model.config)
        if not 0 <= self.mask_token_id < executor.vocab_size:
            raise ValueError(
                f"the parallel-drafting mask token {self.mask_token_id} is outside the draft "
                f"model's vocabulary of {executor.vocab_size}"
            )
        # slot -> committed tokens whose keys are in the draft cache (a prefix of the sequence)
        self.num_computed = np.zeros(executor.kv_cache.max_num_seqs, np.int64)
        self.num_proposals = 0

    def remove(self, slot: int) -> None:
        self.num_computed[slot] = 0
        self.executor.kv_cache.free(slot)

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        ex = self.executor
        device = ex.device
        active, out, probs = proposal_buffers(states, slots, widths, self.vocab_size, device)
        if not active:
            return Proposal(out, [0] * len(slots), probs)
        ids: list[np.ndarray] = []
        starts, counts, rows = [], [], []
        flat = 0
        for i in active:
            slot, k = slots[i], widths[i]
            tokens = states.tokens(slot)
            # Drafts the target rejected were never fed here: only committed tokens enter the
            # cache, so a valid prefix is all that is kept between steps.
            start = min(int(self.num_computed[slot]), len(tokens) - 1)
            new = tokens[start:]
            ids.append(new)
            ids.append(np.full(k - 1, self.mask_token_id, np.int32))
            starts.append(start)
            counts.append(len(new) + k - 1)
            last = flat + len(new) - 1
            rows.extend(range(last, last + k))  # the last committed token, then each mask
            flat += len(new) + k - 1
            self.num_computed[slot] = len(tokens)
        # A target id the draft's smaller vocabulary lacks (an added or special token) enters the
        # draft as id 0: its drafts may be worse there, never wrong (the target verifies them).
        ids_np = np.concatenate(ids).astype(np.int64)
        ids_np[ids_np >= ex.vocab_size] = 0
        input_ids = to_device(ids_np, device)
        positions = to_device(
            flat_ranges(starts, counts),
            device,
        )
        step_slots = [slots[i] for i in active]
        # [sum of k over active, vocab]; one forward unless the catch-up is past the token budget
        logits = forward_in_chunks(
            executor_forward(ex, input_ids, positions, step_slots),
            starts,
            counts,
            np.asarray(rows),
            ex.max_num_tokens,
        )
        self.num_proposals += 1
        # row r of logits belongs to the request that owns it: one choice for the whole batch
        owners = [i for i in active for _ in range(widths[i])]
        tokens, q = choose_tokens(states, [slots[i] for i in owners], logits)
        cols = [c for i in active for c in range(widths[i])]
        idx = (to_device(owners, device), to_device(cols, device))
        out[idx] = tokens
        if probs is not None and q is not None:
            probs[idx[0], idx[1], : q.shape[1]] = q  # draft vocab into the target's
        return Proposal(out, list(widths), probs)
