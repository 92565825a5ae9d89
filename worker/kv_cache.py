"""The worker's KV cache: one slot per running request, rolled back by moving a length.

Layout per layer: keys and values ``[max_num_seqs * max_model_len, num_kv_heads, head_dim]``, token
major, so one ``index_copy_`` writes every new token of a step (flat index = slot * max_model_len +
position). The cache holds no lengths: each request's ``num_computed_tokens`` (in the runner's
request state) says how much of its slot is valid, so rejecting drafts costs nothing.
"""

from __future__ import annotations

import torch


class KVCache:
    """Owned by one ``ModelExecutor``; written only by the attention function during its forward."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        # One extra slot past the last request's: padding tokens write their keys there.
        self.scratch_slot = max_num_seqs
        shape = ((max_num_seqs + 1) * max_model_len, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def capacity_tokens(self) -> int:
        return self.max_num_seqs * self.max_model_len

    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """``k``, ``v``: [num_tokens, num_kv_heads, head_dim]; ``slot_mapping``: [num_tokens] flat rows."""
        self.keys[layer].index_copy_(0, slot_mapping, k)
        self.values[layer].index_copy_(0, slot_mapping, v)

    def gather(
        self, layer: int, slot_idx: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first ``length`` positions of each slot in ``slot_idx`` [B]:
        [B, num_kv_heads, length, head_dim] each (a copy; graph-safe: no host values)."""
        rows = self.max_num_seqs + 1
        keys = self.keys[layer].view(rows, self.max_model_len, *self.keys[layer].shape[1:])
        values = self.values[layer].view(rows, self.max_model_len, *self.values[layer].shape[1:])
        return (
            keys[slot_idx, :length].transpose(1, 2),
            values[slot_idx, :length].transpose(1, 2),
        )

    def view(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one request's first ``length`` positions: [length, heads, head_dim]."""
        start = slot * self.max_model_len
        return self.keys[layer][start : start + length], self.values[layer][start : start + length]
