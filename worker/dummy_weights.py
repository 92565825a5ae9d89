"""Random weights for a model config (``--load-format dummy``, vLLM's name; the synthetic
benchmarks): no weights files, the same tensors for the same config, seed, device and dtype."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from worker.attention import ATTN_IMPLEMENTATION

DUMMY_SEED = 0


def random_model(
    config: PretrainedConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = DUMMY_SEED,
) -> PreTrainedModel:
    """A model of ``config`` with seeded random weights on ``device`` in ``dtype``, without
    gradients, its greedy choice made stable (``stable_greedy``). Every tensor-parallel rank
    draws the same full weights before it takes its shard."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
        ).eval()
    # a model from a config wants gradients: without this every captured warm-up kept its
    # autograd history (all activations and gathered KV) alive, and 8B at batch 64 ran out of
    # memory while capturing
    model.requires_grad_(False)
    stable_greedy(model)
    return model


def stable_greedy(model: PreTrainedModel) -> None:
    """Give the random target a wide argmax margin, so bf16 rounding that differs between batch
    shapes (a draft-carrying step meets other GEMM kernels than a plain one) cannot flip its
    greedy choice: embeddings of unit scale dominate the residual stream, and the LM head holds
    permuted copies of them, so the logit of the next token leads by ~hidden_size; the layers'
    output projections are scaled down so that 32 random layers cannot outgrow it (at 8B and
    batch 64 they did: outputs of the draft and no-draft runs differed, acceptance fell to
    0.2-0.33). The compute per step is unchanged (same shapes, same kernels); without this the
    oracle's "true" continuation stops matching at batch 64 (acceptance fell to 0.02-0.09 in the
    first run). Tied embeddings are untied first: a head equal to the embeddings would make each
    token's argmax itself."""
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w.mul_(1e-3)
        emb = model.get_input_embeddings().weight
        emb.mul_(1.0 / emb.float().std().item())
        perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(2))
        head = model.get_output_embeddings()
        if head.weight.data_ptr() == emb.data_ptr():
            head.weight = torch.nn.Parameter(emb[perm.to(emb.device)].clone(), requires_grad=False)
            model.config.tie_word_embeddings = False
        else:
            head.weight.copy_(emb[perm.to(emb.device)])
