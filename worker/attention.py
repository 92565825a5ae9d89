"""Attention over the worker's own KV cache, plugged into transformers' attention interface.

The runner calls ``model(..., use_cache=False, specd_meta=meta)``. transformers hands every layer's
new queries, keys and values (after RoPE) to ``specd_attention`` together with that keyword; the
function writes the new keys and values into the ``KVCache`` and attends, request by request, over
each request's history plus its new tokens with a causal mask inside the new tokens. transformers'
own mask is switched off (``_no_mask``): the ragged batch is one flat sequence, and its mask would be
wrong and large.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from worker.kv_cache import KVCache

ATTN_IMPLEMENTATION = "specd"


@dataclass
class AttentionMetadata:
    """One forward's layout. Host lists drive the per-request loop; tensors live on the device."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] flat cache row of each new token
    slots: list[int]  # batch_idx -> cache slot
    cu_num_tokens: list[int]  # [num_reqs + 1] query offsets in the flat sequence
    start_positions: list[int]  # batch_idx -> position of its first new token
    causal_masks: list[torch.Tensor | None]  # batch_idx -> [n or query_pad, start + n] bool
    query_pad: int = 0  # > 0: pad each request's queries to this many rows (batch invariance)
    fp32: bool = False  # attention math in float32


@dataclass
class DenseMetadata:
    """A decode-shaped forward (see ``decode_graphs.py``): ``num_reqs`` requests of ``width``
    tokens each, request-major, then padding tokens. Tensors only, so a CUDA graph can replay it."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] flat cache row of each token
    slot_idx: torch.Tensor  # [num_reqs] cache slot of each request row
    mask: torch.Tensor  # [num_reqs, 1, query_rows, max_len] bool
    num_reqs: int
    width: int
    query_rows: int  # >= width: queries padded to this many rows (batch invariance)
    max_len: int  # keys read per request
    fp32: bool = False


def build_dense_metadata(
    kv_cache: KVCache,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_idx: torch.Tensor,
    *,
    num_reqs: int,
    width: int,
    max_len: int,
    query_rows: int,
    fp32: bool,
) -> DenseMetadata:
    """Query (r, j) at position p sees keys 0..p of its own slot; padded query rows see key 0."""
    pos = positions[: num_reqs * width].view(num_reqs, width)
    rows = max(query_rows, width)
    if rows > width:
        pos = F.pad(pos, (0, rows - width))
    keys = torch.arange(max_len, device=positions.device)
    mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # [num_reqs, 1, rows, max_len]
    return DenseMetadata(
        kv_cache, slot_mapping, slot_idx, mask, num_reqs, width, rows, max_len, fp32
    )


def _dense_attention(
    meta: DenseMetadata, layer: int, query: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """query [1, heads, T, D] -> [1, T, heads, D]; rows past num_reqs * width come out zero."""
    b, w = meta.num_reqs, meta.width
    heads, d = query.shape[1], query.shape[3]
    q = query[0, :, : b * w].reshape(heads, b, w, d).transpose(0, 1)  # [B, heads, W, D]
    if meta.query_rows > w:
        q = F.pad(q, (0, 0, 0, meta.query_rows - w))
    k, v = meta.kv_cache.gather(layer, meta.slot_idx, meta.max_len)  # [B, kv_heads, L, D]
    if meta.fp32:
        q, k, v = q.float(), k.float(), v.float()
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.mask, scale=scaling, enable_gqa=True
    )  # [B, heads, rows, D]
    out = query.new_zeros(query.shape[2], heads, d)  # [T, heads, D]
    out[: b * w] = o[:, :, :w].transpose(1, 2).reshape(b * w, heads, d).to(out.dtype)
    return out[None]


def _causal_mask(start: int, n: int, rows: int, device: torch.device) -> torch.Tensor:
    """[rows, start + n]: row j < n sees keys 0 .. start + j; padding rows see key 0 only."""
    q_pos = torch.arange(start, start + rows, device=device)
    q_pos = torch.where(q_pos < start + n, q_pos, 0)
    return torch.arange(start + n, device=device)[None, :] <= q_pos[:, None]


def build_metadata(
    kv_cache: KVCache,
    slots: list[int],
    start_positions: list[int],
    num_tokens: list[int],
    device: torch.device,
    *,
    num_padding: int = 0,
    query_pad: int = 0,
    fp32: bool = False,
) -> AttentionMetadata:
    """``num_padding`` trailing tokens of the flat batch are padding: their keys go to the scratch
    slot and no request attends to them."""
    cu = [0]
    rows: list[int] = []
    masks: list[torch.Tensor | None] = []
    for slot, start, n in zip(slots, start_positions, num_tokens, strict=True):
        if start + n > kv_cache.max_model_len:
            raise ValueError(f"position {start + n} exceeds max_model_len {kv_cache.max_model_len}")
        cu.append(cu[-1] + n)
        base = slot * kv_cache.max_model_len + start
        rows.extend(range(base, base + n))
        if query_pad and n <= query_pad:
            masks.append(_causal_mask(start, n, query_pad, device))
        elif n > 1:
            masks.append(_causal_mask(start, n, n, device))
        else:
            masks.append(None)
    scratch = kv_cache.scratch_slot * kv_cache.max_model_len
    rows.extend(scratch + i % kv_cache.max_model_len for i in range(num_padding))
    slot_mapping = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    return AttentionMetadata(
        kv_cache, slot_mapping, slots, cu, start_positions, masks, query_pad, fp32
    )


def specd_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, D]; key, value [1, kv_heads, T, D] -> output [1, T, heads, D]."""
    meta = kwargs.get("specd_meta")
    layer = module.layer_idx  # type: ignore[attr-defined]
    if isinstance(meta, DenseMetadata):
        # NOTE: the new keys go into the cache before the gather reads them back.
        meta.kv_cache.write(
            layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1)
        )
        return _dense_attention(meta, layer, query, scaling), None
    assert isinstance(meta, AttentionMetadata), "call the model with specd_meta=AttentionMetadata"
    cache = meta.kv_cache
    cache.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = query.new_zeros(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, D]
    cu = meta.cu_num_tokens
    for i, slot in enumerate(meta.slots):
        a, b = cu[i], cu[i + 1]
        k, v = cache.view(layer, slot, meta.start_positions[i] + b - a)  # [L, kv_heads, D]
        q = query[:, :, a:b]  # [1, heads, n, D]
        mask = meta.causal_masks[i]
        if mask is not None and mask.shape[0] > b - a:  # padded queries: one shape for any n
            q = F.pad(q, (0, 0, 0, mask.shape[0] - (b - a)))
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, L, D]
        if meta.fp32:
            q, k, v = q.float(), k.float(), v.float()
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True
        )  # [1, heads, rows, D]
        out[a:b] = o[0, :, : b - a].transpose(0, 1).to(out.dtype)
    return out[None], None


def _no_mask(*args: object, **kwargs: object) -> None:
    return None


# Opaque to torch.compile (compiled.py): it writes the KV cache in place and loops over requests on
# the ragged path, so compiled decoder layers call it eagerly between their two halves. Eagerly the
# wrapper costs ~0.3 us a call.
AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(specd_attention))
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
