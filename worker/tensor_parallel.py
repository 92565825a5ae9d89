"""Tensor parallelism for the supported decoder architectures (Llama, Qwen2 and their kin).

``shard_model`` rewrites a loaded model in place for one rank of a ``torch.distributed`` group:
q/k/v and gate/up projections become column-parallel (each rank keeps its share of the heads and
of the MLP's inner width), o and down projections row-parallel (partial products summed with one
all-reduce), and the LM head vocab-parallel (each rank projects its slice of the vocabulary; the
slices are gathered so every rank holds the full logits and takes the same decisions). Embeddings
and norms are replicated. Attention needs nothing else: HF's attention reshapes by head_dim, so a
rank's layers see only its own heads, and the worker's KV cache holds only those.

Every rank runs the same ``ModelRunner`` on the same step (rank 0 receives it from the scheduler
and broadcasts it); the sharded layers are the only place the ranks talk. NCCL on GPUs, gloo on
CPUs (how the tests run it with two processes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


class ColumnParallelLinear(nn.Module):
    """This rank's rows of the weight (its output features): no communication."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        n = linear.out_features // world
        self.weight = nn.Parameter(linear.weight.detach()[rank * n : (rank + 1) * n].clone())
        self.bias = (
            nn.Parameter(linear.bias.detach()[rank * n : (rank + 1) * n].clone())
            if linear.bias is not None
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of the weight (its input features); partial outputs are summed across
    the group, then the bias is added once."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group: Any) -> None:
        super().__init__()
        n = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * n : (rank + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelLMHead(nn.Module):
    """This rank's slice of the vocabulary (ceil(vocab / world) rows, the last slice padded with
    zero rows); the logits of all slices are gathered and the padding cut off."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group: Any) -> None:
        super().__init__()
        vocab = linear.out_features
        n = -(-vocab // world)
        rows = linear.weight.detach()[rank * n : min((rank + 1) * n, vocab)]
        weight = rows.new_zeros((n, rows.shape[1]))
        weight[: len(rows)] = rows
        self.weight = nn.Parameter(weight)
        self.vocab, self.world, self.group = vocab, world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()  # [..., ceil(vocab / world)]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab]


def check_shardable(config: Any, world: int) -> None:
    """Raise ValueError naming the first size the group does not divide."""
    cfg = config.get_text_config()
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        "intermediate_size": cfg.intermediate_size,
    }
    for name, value in sizes.items():
        if value % world:
            raise ValueError(
                f"tensor parallel size {world} does not divide the model's {name} ({value})"
            )


def shard_model(model: nn.Module, rank: int, world: int, group: Any = None) -> int:
    """Shard ``model`` in place for ``rank`` of ``world``; returns this rank's KV heads."""
    check_shardable(model.config, world)
    if world == 1:
        cfg = model.config.get_text_config()
        return int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
    decoder = model.get_decoder()
    for layer in decoder.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in COLUMN:
                if hasattr(parent, name):
                    setattr(parent, name, ColumnParallelLinear(getattr(parent, name), rank, world))
            for name in ROW:
                if hasattr(parent, name):
                    setattr(
                        parent, name, RowParallelLinear(getattr(parent, name), rank, world, group)
                    )
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        # tied embeddings: the LM head gets its own (sliced) copy; the embedding stays whole
        model.config.tie_word_embeddings = False
    model.lm_head = VocabParallelLMHead(head, rank, world, group)
    cfg = model.config.get_text_config()
    local = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)) // world
    model.specd_num_kv_heads = local  # read by ModelExecutor for its KV cache
    return local
