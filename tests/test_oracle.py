"""The batched fast path against the plain reference step (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models import VOCAB, reference_copy, tiny_model
from tests.reference import speculative_step, target_probs
from worker.rejection import VerifyInput, verify


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("with_q", [False, True])
def test_batched_verify_matches_the_plain_reference_step(temperature: float, with_q: bool) -> None:
    seed = 4242
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    ref = reference_copy(tiny_model("qwen2", seed=8))
    k = 4
    reqs = []
    for _ in range(6):
        prefix = rng.integers(3, VOCAB, int(rng.integers(2, 10))).tolist()
        w = int(rng.integers(0, k + 1))
        p = target_probs(ref, prefix, [], temperature)  # peek: make some drafts right
        drafts = []
        for _ in range(w):
            guess = int(p[-1].argmax()) if rng.random() < 0.6 else int(rng.integers(3, VOCAB))
            drafts.append(guess)
            p = target_probs(ref, prefix, drafts, temperature)
        reqs.append((prefix, drafts))
    # batched inputs
    rows, cu, d = [], [0], torch.zeros((len(reqs), k), dtype=torch.long)
    q = torch.zeros((len(reqs), k, VOCAB)) if with_q else None
    for i, (prefix, drafts) in enumerate(reqs):
        with torch.no_grad():
            logits = ref(torch.tensor([prefix + drafts])).logits[0, len(prefix) - 1 :].float()
        rows.append(logits)
        cu.append(cu[-1] + len(drafts) + 1)
        d[i, : len(drafts)] = torch.tensor(drafts, dtype=torch.long)
        if q is not None:
            q[i] = torch.rand(k, VOCAB, generator=gen).softmax(-1)
    uniforms = torch.rand(len(reqs), k + 2, generator=gen)
    out = verify(
        VerifyInput(
            logits=torch.cat(rows),
            cu_rows=cu,
            num_drafts=[len(x[1]) for x in reqs],
            draft_token_ids=d,
            draft_probs=q,
            temperature=torch.full((len(reqs),), temperature or 1.0),
            top_k=torch.zeros(len(reqs), dtype=torch.long),
            top_p=torch.ones(len(reqs)),
            greedy=torch.full((len(reqs),), temperature == 0),
            uniforms=uniforms,
        )
    )
    for i, (prefix, drafts) in enumerate(reqs):
        p = target_probs(ref, prefix, drafts, temperature)
        want = speculative_step(
            p,
            drafts,
            None if q is None else q[i, : len(drafts)],
            uniforms[i, : len(drafts) + 1].tolist(),
        )
        got = [t for t in out.output_token_ids[i].tolist() if t >= 0]
        assert got == want, (i, drafts, got, want)
        assert int(out.num_accepted[i]) == len(want) - 1
