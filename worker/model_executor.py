"""One model and its paged KV cache: run a forward over any layout and return the logits the caller
asks for."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import PreTrainedModel

from worker.attention import (
    ATTN_IMPLEMENTATION,
    PagedMetadata,
    build_dense_metadata,
    build_metadata,
)
from worker.compiled import CompiledLayers
from worker.decode_graphs import DecodeGraphs
from worker.fused_layers import FusedDecoder
from worker.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from worker.paged_kernel import use_kernel
from worker.ragged_graphs import RaggedGraphs

BATCH_INVARIANT_MODES = ("off", "pad", "pad-fp32")
TOKEN_BUCKET = 64
QUERY_PAD = 16


def kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of ``model``'s KV cache on this rank."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = (
        # a tensor-parallel rank holds only its share of the KV heads (tensor_parallel.py)
        getattr(model, "specd_num_kv_heads", None)
        or getattr(cfg, "num_key_value_heads", None)
        or cfg.num_attention_heads
    )
    return int(cfg.num_hidden_layers), int(kv_heads), int(head_dim)


def kv_blocks_for_memory(model: PreTrainedModel, gib: float, block_size: int) -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``gib`` GiB for ``model``."""
    layers, kv_heads, head_dim = kv_shape(model)
    dtype = next(model.parameters()).dtype
    per_block = 2 * layers * kv_heads * head_dim * block_size * dtype.itemsize
    return int(gib * 2**30) // per_block


class ModelExecutor:
    """Owns ``model``'s KV cache. ``forward`` is the only way tokens enter the cache."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_num_seqs: int,
        max_model_len: int,
        batch_invariant: str = "off",
        decode_width: int = 1,
        cuda_graphs: bool = True,
        compile_layers: bool = False,
        num_kv_blocks: int | None = None,
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_tokens: int = 2048,
    ) -> None:
        """``batch_invariant``: "off"; "pad" rounds every forward up to a multiple of
        ``TOKEN_BUCKET`` tokens and pads each request's queries to ``QUERY_PAD`` rows, so a token's
        arithmetic does not depend on how many tokens share its forward (drafts or not); "pad-fp32"
        also runs attention in float32. Needed for bf16 on GPU; float32 on CPU is exact without.

        ``decode_width``: the most tokens a request runs in a decode step (1 + its drafts). Steps
        where every request runs 1..decode_width tokens take the padded layout of
        ``DecodeGraphs`` (replayed from CUDA graphs on GPU unless ``cuda_graphs`` is False).

        ``compile_layers``: decode-shaped forwards run torch.compile'd decoder layers
        (compiled.py).

        ``num_kv_blocks`` blocks of ``kv_block_size`` tokens make the paged KV cache (None: the
        memory of ``max_num_seqs`` full-length slots, kv_cache.py).

        With the paged kernel, other steps of up to ``max_num_tokens`` tokens (prefill chunks,
        mixed steps) replay ``RaggedGraphs`` (CUDA graphs per token bucket; eager elsewhere)."""
        if batch_invariant not in BATCH_INVARIANT_MODES:
            raise ValueError(f"batch_invariant must be one of {BATCH_INVARIANT_MODES}")
        self.batch_invariant = batch_invariant
        self.max_num_tokens = max_num_tokens  # the most tokens a caller should run in one forward
        if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model must use attn_implementation={ATTN_IMPLEMENTATION!r} (load it with "
                "worker.model_loader.load_model): other attention ignores the worker's KV cache"
            )
        cfg = model.config.get_text_config()
        # decode-shaped forwards run torch.compile'd layers (compiled.py); prefill runs them plain
        self.compiled = CompiledLayers.for_model(model) if compile_layers else None
        # otherwise Llama-shaped decoders run specd's fused forward (fused_layers.py)
        self.fused = FusedDecoder.for_model(model, compiled=compile_layers)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(cfg.vocab_size)
        num_layers, num_kv_heads, head_dim = kv_shape(model)
        self.kv_cache = KVCache(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            dtype=self.dtype,
            device=self.device,
            block_size=kv_block_size,
            num_blocks=num_kv_blocks,
        )
        # attention straight from the paged cache (paged_kernel.py) where it can run
        self.kernel = use_kernel(self.device, head_dim, fp32=batch_invariant == "pad-fp32")
        self.backbone = model.get_decoder()
        self._placeholder_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        self.lm_head = model.get_output_embeddings()
        # where the last forward's tokens' keys went (last_cache_rows)
        self._rows: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
        invariant = batch_invariant != "off"
        self.decode = DecodeGraphs(
            self._dense_forward,
            self.kv_cache,
            width=max(decode_width, 1),
            device=self.device,
            use_graphs=cuda_graphs,
            token_bucket=TOKEN_BUCKET if invariant else 1,
            # the paged kernel reads only each request's own keys: one length serves all
            length_buckets=not self.kernel,
        )
        self.ragged = (
            RaggedGraphs(
                self._backbone,
                self.kv_cache,
                max_tokens=max_num_tokens,
                device=self.device,
                smallest=TOKEN_BUCKET,
                use_graphs=cuda_graphs,
            )
            if self.kernel
            else None
        )

    def _dense_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        slot_idx: torch.Tensor,
        num_reqs: int,
        width: int,
        max_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The padded decode layout: every tensor argument is a static buffer (graph-safe).
        Returns logits [T, vocab] float32 for every row and hidden states [T, hidden]."""
        invariant = self.batch_invariant != "off"
        meta = build_dense_metadata(
            self.kv_cache,
            positions,
            slot_mapping,
            slot_idx,
            num_reqs=num_reqs,
            width=width,
            max_len=max_len,
            query_rows=QUERY_PAD if invariant else 0,
            fp32=self.batch_invariant == "pad-fp32",
            kernel=self.kernel,
        )
        with self.compiled.active() if self.compiled is not None else nullcontext():
            hidden = self._backbone(input_ids, positions, meta)  # [T, hidden]
        logits = self.lm_head(hidden).float()[:, : self.vocab_size]  # [T, vocab]
        return logits, hidden

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: list[int],
        start_positions: list[int],
        num_tokens: list[int],
        logits_indices: torch.Tensor,
        device_starts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over a flat batch.

        input_ids, positions: [num_tokens_total]; logits_indices: [num_logits] rows to project.
        ``device_starts`` [B] (a chained step, ``worker.chain``; the decode graphs' path only):
        each request's first position on the device, where ``start_positions`` are upper bounds
        (the blocks are held up to those).
        Returns (logits [num_logits, vocab] float32, hidden states [num_tokens_total, hidden]).
        Each slot first holds KV blocks up to its last new position (``KVCacheFull`` if none
        are left: the caller's accounting failed).
        """
        self.kv_cache.allocate(
            slots, [s + n for s, n in zip(start_positions, num_tokens, strict=True)]
        )
        if self.decode.fits(num_tokens, start_positions):
            out = self.decode.forward(
                input_ids, slots, start_positions, num_tokens, logits_indices, device_starts
            )
            self._rows = self.decode.last_rows
            return out
        assert device_starts is None, "a chained step runs on the decode graphs' path"
        if self.ragged is not None and self.ragged.fits(len(input_ids), len(slots)):
            hidden = self.ragged.forward(input_ids, slots, start_positions, num_tokens)
            self._rows = self.ragged.last_rows
            logits = self.lm_head(hidden[logits_indices]).float()
            return logits[:, : self.vocab_size], hidden
        pad = 0
        if self.batch_invariant != "off":
            total = len(input_ids)
            pad = -total % TOKEN_BUCKET
            if pad:
                input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
                positions = torch.cat([positions, positions.new_zeros(pad)])
        meta = build_metadata(
            self.kv_cache,
            slots,
            start_positions,
            num_tokens,
            self.device,
            num_padding=pad,
            query_pad=QUERY_PAD if self.batch_invariant != "off" else 0,
            fp32=self.batch_invariant == "pad-fp32",
            kernel=self.kernel,
        )
        hidden = self._backbone(input_ids, positions, meta)  # [num_tokens_total, hidden]
        self._rows = meta.slot_mapping
        logits = self.lm_head(hidden[logits_indices]).float()  # [num_logits, vocab]
        return logits[:, : self.vocab_size], hidden

    def last_cache_rows(self) -> torch.Tensor:
        """[tokens of the last forward (padding after them)] the flat KV-cache row each of its
        tokens wrote, on the device, in the forward's flat order. Valid until the next forward
        is launched (the graphs' buffers are reused)."""
        rows = self._rows
        assert rows is not None, "no forward has run"
        return rows[0][rows[1]] if isinstance(rows, tuple) else rows

    def _backbone(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object
    ) -> torch.Tensor:
        """The decoder over one flat sequence: [T] ids and positions -> [T, hidden]."""
        if self.fused is not None:
            assert isinstance(meta, PagedMetadata)
            return self.fused.forward(input_ids, positions, meta)
        out = self.backbone(
            input_ids=input_ids[None],
            position_ids=positions[None],
            # An already-built 4D mask makes transformers skip its own mask work, which would
            # otherwise scan position_ids for packed sequences (a host sync every forward).
            # specd_attention never reads it: causality comes from specd_meta.
            attention_mask=self._placeholder_mask,
            use_cache=False,
            specd_meta=meta,
        )
        return out.last_hidden_state[0]
