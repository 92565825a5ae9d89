"""Attention over the worker's paged KV cache, plugged into transformers' attention interface.

The runner calls ``model(..., use_cache=False, specd_meta=meta)``. transformers hands every layer's
new queries, keys and values (after RoPE) to ``specd_attention`` together with that keyword; the
function writes the new keys and values into the ``KVCache`` and attends once for the whole batch:
every request's keys are gathered through its block table into a padded ``[B, kv_heads, L, D]``,
its queries into a padded ``[B, heads, Q, D]``, and one SDPA call runs under a ``[B, 1, Q, L]``
mask (query row j of request b sees its positions 0 .. start_b + j). No per-request loop: prefill
chunks, decodes with drafts and mixed steps all take this path. transformers' own mask is switched
off (``_no_mask``): the batch is one flat sequence, and its mask would be wrong and large.

Two builders make the same ``PagedMetadata``: ``build_metadata`` from host lists (any layout), and
``build_dense_metadata`` from device tensors only (the padded decode layout of ``decode_graphs.py``,
replayed by CUDA graphs). Two kernels run behind it. On CUDA with triton, ``paged_kernel.py``
reads the block table itself: one launch per layer for any mix of prefill chunks, decodes and
drafts, no gather, no mask, no query padding (``kernel=True``; ``SPECD_ATTENTION_BACKEND=sdpa``
turns it off). The padded SDPA below is the portable kernel (CPU, and float32 attention in
``pad-fp32``). torch 2.13's CPU build has both ``flex_attention`` and
``torch.nn.attention.varlen``; they are not used here: FlexAttention is only fast compiled (an
inductor C++ build per shape, minutes on the test machines) and eager it materialises the scores,
and varlen attention does not read a block table (the keys would still be gathered, packed).

Batch invariance: a query row's math depends only on its own request's keys. Padded key columns
are masked (they add exact zeros to the softmax sums) and padded query rows are separate rows, so
the padding another request causes does not change this request's numbers on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from worker.host_copy import to_device
from worker.kv_cache import KVCache
from worker.paged_kernel import paged_attention

ATTN_IMPLEMENTATION = "specd"


@dataclass
class PagedMetadata:
    """One forward's layout over B requests. Tensors only (a CUDA graph can replay it)."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] flat cache row of each token (padding: the scratch block)
    block_table: torch.Tensor  # [B, nb] physical blocks of each request's positions 0 .. L - 1
    query_index: torch.Tensor | None  # [B, Q] flat token of query row j of request b (padding: 0)
    out_index: (
        torch.Tensor | None
    )  # [T] row of the [B * Q + 1] outputs of each token; B * Q is zeros
    mask: torch.Tensor | None  # [B, 1, Q, L] bool: query row j of request b sees key l
    fp32: bool = False  # attention math in float32
    # the Triton kernel's (paged_kernel.py; query_index, out_index and mask are then None)
    kernel: bool = False
    query_start: torch.Tensor | None = None  # [B + 1] first flat token of each request
    positions: torch.Tensor | None = None  # [T] position of each flat token
    unowned_rows: bool = False  # some flat tokens belong to no request (their outputs: zeros)


def _mask(q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """q_pos [B, Q] (padding rows 0: they see key 0) -> [B, 1, Q, num_keys]."""
    keys = torch.arange(num_keys, device=q_pos.device)
    return (keys[None, None, :] <= q_pos[:, :, None])[:, None]


def kernel_metadata(
    kv_cache: KVCache,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    positions: torch.Tensor,
    *,
    unowned_rows: bool,
) -> PagedMetadata:
    """The Triton kernel's metadata (``paged_kernel.py``): the first flat token of each request
    and each token's position instead of query and output indices and a mask."""
    return PagedMetadata(
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        block_table=block_table,
        query_index=None,
        out_index=None,
        mask=None,
        kernel=True,
        query_start=query_start,
        positions=positions,
        unowned_rows=unowned_rows,
    )


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
    kernel: bool = False,
) -> PagedMetadata:
    """Any layout: request b runs ``num_tokens[b]`` tokens from ``start_positions[b]``, flat and
    request-major, then ``num_padding`` padding tokens (their keys go to the scratch block and no
    request attends to them). Its slots must hold blocks up to their ends (``allocate``).
    ``query_pad`` > 0: queries are padded to a multiple of it (one shape for any draft width).
    ``kernel``: metadata for the Triton kernel (no query padding, no mask)."""
    b = len(slots)
    starts = np.asarray(start_positions, np.int64)
    counts = np.asarray(num_tokens, np.int64)
    ends = starts + counts
    if b and int(ends.max()) > kv_cache.max_model_len:
        raise ValueError(
            f"position {int(ends.max())} exceeds max_model_len {kv_cache.max_model_len}"
        )
    q = int(counts.max()) if b else 1
    if query_pad:
        q = -(-q // query_pad) * query_pad
    nb = kv_cache.blocks.blocks_for(int(ends.max())) if b else 1
    total = int(counts.sum())
    cu = np.concatenate([[0], np.cumsum(counts)])
    # flat token -> (request, offset)
    owner = np.repeat(np.arange(b), counts)
    offset = np.arange(total) - cu[owner]
    positions = starts[owner] + offset
    slots_np = np.asarray(slots, np.int64)
    pad_rows = np.arange(num_padding) % kv_cache.block_size  # the scratch block
    slot_mapping = np.concatenate(
        [kv_cache.blocks.cache_rows(slots_np[owner], positions), pad_rows]
    )
    out_index = np.concatenate([owner * q + offset, np.full(num_padding, b * q)])
    j = np.arange(q)
    real = j[None, :] < counts[:, None]  # [B, Q]
    query_index = np.where(real, cu[:-1, None] + j[None, :], 0)
    q_pos = np.where(real, starts[:, None] + j[None, :], 0)
    block_table = kv_cache.blocks.table_np[slots_np, :nb]
    if kernel:
        flat = to_device(
            np.concatenate(
                [slot_mapping, cu, positions, np.zeros(num_padding, np.int64), block_table.ravel()]
            ),
            device,
            dtype=None,
        )
        t = total + num_padding
        parts = torch.split(flat, [t, b + 1, t, b * nb])
        return kernel_metadata(
            kv_cache,
            parts[0],
            parts[3].view(b, nb),
            parts[1],
            parts[2],
            unowned_rows=num_padding > 0,
        )
    # one host-to-device copy for the five index arrays
    flat = to_device(
        np.concatenate(
            [slot_mapping, out_index, query_index.ravel(), q_pos.ravel(), block_table.ravel()]
        ),
        device,
        dtype=None,
    )
    t = total + num_padding
    parts = torch.split(flat, [t, t, b * q, b * q, b * nb])
    return PagedMetadata(
        kv_cache=kv_cache,
        slot_mapping=parts[0],
        block_table=parts[4].view(b, nb),
        query_index=parts[2].view(b, q),
        out_index=parts[1],
        mask=_mask(parts[3].view(b, q), nb * kv_cache.block_size),
        fp32=fp32,
    )


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
    kernel: bool = False,
) -> PagedMetadata:
    """The padded decode layout (``decode_graphs.py``): ``num_reqs`` requests of ``width`` tokens
    each, request-major, then padding tokens; request r reads the keys of its first ``max_len``
    positions through row ``slot_idx[r]`` of the device block table. Built from device tensors
    only. Query (r, j) at position p sees keys 0..p; padded query rows see key 0."""
    device = positions.device
    if kernel:
        nb = kv_cache.blocks.blocks_for(max_len)
        return kernel_metadata(
            kv_cache,
            slot_mapping,
            kv_cache.blocks.table[slot_idx, :nb],
            torch.arange(num_reqs + 1, device=device) * width,
            positions,
            unowned_rows=positions.shape[0] > num_reqs * width,
        )
    rows = max(query_rows, width)
    pos = positions[: num_reqs * width].view(num_reqs, width)
    if rows > width:
        pos = F.pad(pos, (0, rows - width))
    nb = kv_cache.blocks.blocks_for(max_len)
    block_table = kv_cache.blocks.table[slot_idx, :nb]  # [B, nb]
    tokens = torch.arange(num_reqs * width, device=device).view(num_reqs, width)
    query_index = F.pad(tokens, (0, rows - width))  # [B, rows]
    t = torch.arange(positions.shape[0], device=device)
    out_index = torch.where(
        t < num_reqs * width, (t // width) * rows + t % width, num_reqs * rows
    )  # [T]
    return PagedMetadata(
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        block_table=block_table,
        query_index=query_index,
        out_index=out_index,
        mask=_mask(pos, nb * kv_cache.block_size),
        fp32=fp32,
    )


def attention_output(
    meta: PagedMetadata, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The paged kernel's output buffer [T, heads, D]: zeros where some rows belong to no
    request (the kernel never writes them), else uninitialised."""
    alloc = torch.zeros if meta.unowned_rows else torch.empty
    return alloc(shape, dtype=dtype, device=device)


def attend_flat(
    meta: PagedMetadata,
    layer: int,
    q: torch.Tensor,
    scaling: float | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, heads, D] (any strides) -> [T, heads, D] over the cache's keys of ``layer`` (the new
    ones written first); padding tokens come out zero. ``out`` (the kernel's only): a buffer
    whose padding rows are zeros already, reused across layers (the kernel writes only the rows
    of requests)."""
    heads, d = q.shape[1], q.shape[2]
    if meta.kernel:
        if out is None:
            out = attention_output(meta, tuple(q.shape), q.dtype, q.device)
        assert meta.query_start is not None and meta.positions is not None
        cache = meta.kv_cache
        paged_attention(
            q,
            cache.keys[layer],
            cache.values[layer],
            meta.block_table,
            meta.query_start,
            meta.positions,
            cache.block_size,
            scaling,
            out,
        )
        return out
    assert meta.query_index is not None and meta.out_index is not None
    b, q_rows = meta.query_index.shape
    qp = q[meta.query_index].transpose(1, 2)  # [B, heads, Q, D]
    k, v = meta.kv_cache.gather(layer, meta.block_table)  # [B, kv_heads, L, D]
    if meta.fp32:
        qp, k, v = qp.float(), k.float(), v.float()
    o = F.scaled_dot_product_attention(
        qp, k, v, attn_mask=meta.mask, scale=scaling, enable_gqa=True
    )  # [B, heads, Q, D]
    o = o.transpose(1, 2).reshape(b * q_rows, heads, d).to(q.dtype)
    o = torch.cat([o, o.new_zeros(1, heads, d)])  # [B * Q + 1, heads, D]: the last row is zeros
    return o[meta.out_index]


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
    assert isinstance(meta, PagedMetadata), "call the model with specd_meta=PagedMetadata"
    layer = module.layer_idx  # type: ignore[attr-defined]
    # NOTE: the new keys go into the cache before the gather reads them back.
    meta.kv_cache.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = attend_flat(meta, layer, query[0].transpose(0, 1), scaling)  # [T, heads, D]
    return out[None], None


def _no_mask(*args: object, **kwargs: object) -> None:
    return None


# Opaque to torch.compile (compiled.py): it writes the KV cache in place, so compiled decoder
# layers call it eagerly between their two halves. Eagerly the wrapper costs ~0.3 us a call.
AttentionInterface.register(ATTN_IMPLEMENTATION, torch.compiler.disable(specd_attention))
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
