"""A runner with each kind of drafter on a tiny target (fp32, seeded), for tests and benches."""

from __future__ import annotations

import torch

from tests.models import VOCAB, near_copy, reference_copy, tiny_model
from worker.attention import ATTN_IMPLEMENTATION
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.draft_model import DraftModelDrafter
from worker.drafters.eagle import EagleDrafter
from worker.drafters.ngram import NgramDrafter
from worker.drafters.parallel import ParallelDrafter
from worker.eagle_head import EagleHead, head_config
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner

K = 4
MASK = 61  # the parallel drafter's mask token, inside the tiny vocabulary
KINDS = ("none", "ngram", "draft_model", "parallel", "eagle")


def drafting_runner(
    kind: str,
    seed: int,
    *,
    device: str = "cpu",
    cuda_graphs: bool = True,
    max_num_seqs: int = 2,
    max_model_len: int = 128,
) -> tuple[ModelRunner, torch.nn.Module]:
    """A runner with a drafter of ``kind`` (one of ``KINDS``; K = 4 drafts) on a tiny Llama
    target, and the target's reference on the CPU. The draft model and the parallel draft are
    the target with seeded noise (drawn on the CPU), the EAGLE head is random."""
    target = tiny_model("llama", seed)
    ref = reference_copy(target)
    draft = near_copy(target, seed + 1)
    target = target.to(device)

    def executor(model: torch.nn.Module) -> ModelExecutor:
        return ModelExecutor(
            model,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            decode_width=1 + K,
            cuda_graphs=cuda_graphs,
        )

    drafter: Drafter = NoDrafter()
    if kind == "ngram":
        drafter = NgramDrafter(min_n=1, max_n=3, max_num_tokens=K)
    elif kind == "draft_model":
        drafter = DraftModelDrafter(executor(draft.to(device)), max_num_tokens=K)
    elif kind == "parallel":
        draft.config.mask_token_id = MASK
        drafter = ParallelDrafter(executor(draft.to(device)), max_num_tokens=K)
    elif kind == "eagle":
        torch.manual_seed(seed + 2)
        head = EagleHead(head_config(target.config), ATTN_IMPLEMENTATION).eval().to(device)
        drafter = EagleDrafter(
            head,
            target,
            vocab_size=VOCAB,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_tokens=K,
        )
    elif kind != "none":
        raise ValueError(f"drafter kind {kind!r} is not one of {KINDS}")
    runner = ModelRunner(
        executor(target),
        drafter,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_draft_tokens=K,
    )
    return runner, ref
