"""The EAGLE-style drafter: a trained head (``worker/eagle_head.py``) on the target's hidden states.

Per request the head keeps its own KV cache over the pairs (f_t, x_{t+1}) of the committed sequence:
f_t is the target's hidden state at position t (given by the runner through ``observe`` once the
position is committed), x_{t+1} the next committed token. With L committed tokens the target has
given f_0 .. f_{L-2}; ``propose`` first catches the head up to pair L-2 (ragged forwards of at most
the worker's token budget, for every request at once), whose output predicts f_{L-1} and, through
the target's LM head, draft 1. Each further draft feeds back (predicted hidden, previous draft).
Draft pairs sit past the committed pairs in the head's cache and are dropped by keeping its length
at L-1. The head's cache and the store of f_t are paged like the target's (``bind``).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.attention import ATTN_IMPLEMENTATION, build_metadata
from worker.block_table import BlockTable
from worker.drafters.base import Drafter, Proposal, choose_tokens
from worker.drafters.catch_up import forward_in_chunks
from worker.eagle_head import EagleHead
from worker.fused_layers import FusedDecoder
from worker.host_copy import to_device
from worker.kv_cache import KVCache, draft_num_blocks
from worker.model_executor import ModelExecutor
from worker.paged_kernel import use_kernel
from worker.requests import RequestStates
from worker.step_batch import flat_ranges


class EagleDrafter(Drafter):
    name = "eagle"
    needs_hidden_states = True

    def __init__(
        self,
        head: EagleHead,
        target: torch.nn.Module,
        *,
        vocab_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_tokens: int,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """``max_num_tokens``: the most drafts a request proposes; ``max_num_batched_tokens``:
        the most pairs one catch-up forward of the head runs (None: the target's token budget,
        its executor's ``max_num_tokens``)."""
        cfg = head.config
        param = next(head.parameters())
        self.head = head
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = param.device
        self.dtype = param.dtype
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kernel = use_kernel(self.device, self.head_dim)  # the target's attention kernel
        # Sized by the target's paged cache in ``bind``: the head's own KV cache, and
        # [target cache rows, H] the target's hidden states of committed positions, each at the
        # flat row where the target keeps that position's keys.
        self._kv_cache: KVCache | None = None
        self._features: torch.Tensor | None = None
        self._target_blocks: BlockTable | None = None
        self.num_features = np.zeros(max_num_seqs, np.int64)  # slot -> positions with f_t
        self.num_computed = np.zeros(max_num_seqs, np.int64)  # slot -> pairs in the head's cache
        self._placeholder_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        # the head's one layer through the fused forward (fused_layers.py) where it applies
        self.fused = FusedDecoder.for_model(head.layers, compiled=False)

    def bind(self, target: ModelExecutor) -> None:
        """The feature store pages through the target's block table: one row per row of the
        target's KV cache, so its memory follows the target's KV capacity (``--kv-cache-memory``)
        rather than max_num_seqs x max_model_len (an 8B target at 32k context and 64 sequences:
        17 GB). The head's own KV cache gets the target's block count plus the drafts' reach."""
        assert self._features is None, "an EagleDrafter serves one runner: bind it once"
        tc = target.kv_cache
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = target.max_num_tokens
        if (tc.max_num_seqs, tc.max_model_len) != (self.max_num_seqs, self.max_model_len):
            raise ValueError(
                f"the EAGLE drafter was built for {self.max_num_seqs} sequences of "
                f"{self.max_model_len} tokens, the target's cache for {tc.max_num_seqs} of "
                f"{tc.max_model_len}"
            )
        cfg = self.head.config
        self._target_blocks = tc.blocks
        self._features = torch.zeros(
            ((tc.num_blocks + 1) * tc.block_size, cfg.hidden_size),
            dtype=self.dtype,
            device=self.device,
        )
        self._kv_cache = KVCache(
            num_layers=1,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=self.head_dim,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
            block_size=tc.block_size,
            num_blocks=draft_num_blocks(
                tc.num_blocks,
                self.max_num_seqs,
                self.max_model_len,
                tc.block_size,
                self.max_num_tokens,
            ),
        )

    @property
    def kv_cache(self) -> KVCache:
        assert self._kv_cache is not None, "EagleDrafter.bind(target) first (ModelRunner does)"
        return self._kv_cache

    @property
    def features(self) -> torch.Tensor:
        """[target cache rows, H]"""
        assert self._features is not None, "EagleDrafter.bind(target) first (ModelRunner does)"
        return self._features

    def feature_rows(self, slots: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """[N] the feature store's rows of (slot, position) pairs, on the device."""
        assert self._target_blocks is not None, "EagleDrafter.bind(target) first"
        return to_device(self._target_blocks.cache_rows(slots, positions), self.device)

    @classmethod
    def from_files(
        cls,
        head_dir: str,
        target: torch.nn.Module,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_num_tokens: int,
        max_num_batched_tokens: int | None = None,
    ) -> EagleDrafter:
        """The head in ``head_dir`` (or ``"embedded"``), on the target's device and dtype."""
        param = next(target.parameters())
        head = EagleHead.load(
            head_dir,
            attn_implementation=ATTN_IMPLEMENTATION,
            dtype=param.dtype,
            device=param.device,
        )
        return cls(
            head,
            target,
            vocab_size=target.config.get_text_config().vocab_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_tokens=max_num_tokens,
            max_num_batched_tokens=max_num_batched_tokens,
        )

    def remove(self, slot: int) -> None:
        self.num_features[slot] = 0
        self.num_computed[slot] = 0
        self.kv_cache.free(slot)

    def observe(self, rows: torch.Tensor, hidden: torch.Tensor) -> None:
        # the feature store's rows are the target's cache rows: one scatter, no host indices
        self.features.index_copy_(0, rows, hidden.to(self.dtype))

    def committed(self, slots: np.ndarray, lengths: np.ndarray) -> None:
        self.num_features[slots] = np.maximum(self.num_features[slots], lengths)

    def _run(
        self,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        embeds: torch.Tensor,
        feats: torch.Tensor,
        last_rows: torch.Tensor,
    ) -> torch.Tensor:
        """One head forward over a flat batch of pairs; the predicted hidden at ``last_rows``."""
        self.kv_cache.allocate(slots, [s + c for s, c in zip(starts, counts, strict=True)])
        meta = build_metadata(self.kv_cache, slots, starts, counts, self.device, kernel=self.kernel)
        # the kernel's metadata already holds every token's position on the device
        positions = (
            meta.positions
            if meta.positions is not None
            else to_device(flat_ranges(starts, counts), self.device)
        )
        if self.fused is not None:
            x = self.head.inputs(embeds, feats)  # [T, H]
            return self.fused.forward_embeds(x, positions, meta)[last_rows]
        out = self.head(
            embeds[None],
            feats[None],
            positions[None],
            attention_mask=self._placeholder_mask,
            specd_meta=meta,
        )  # [1, T, H]
        return out[0, last_rows]

    @torch.inference_mode()
    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        device = self.device
        kmax = max(widths, default=0)
        out = torch.zeros((len(slots), max(kmax, 1)), dtype=torch.long, device=device)
        active = [i for i, k in enumerate(widths) if k > 0]
        sampled = any(states.sampling[slots[i]].temperature > 0 for i in active)  # type: ignore[union-attr]
        probs = (
            torch.zeros((len(slots), max(kmax, 1), self.vocab_size), device=device)
            if sampled
            else None
        )
        if not active:
            return Proposal(out, [0] * len(slots), probs)
        # Catch up: pairs (f_t, x_{t+1}) for t = num_computed .. L-2 of every active request.
        run_slots, starts, counts, tok_idx, feat_slot, feat_pos = [], [], [], [], [], []
        for i in active:
            slot = slots[i]
            length = int(states.num_tokens[slot])
            assert self.num_features[slot] >= length - 1, "target hidden states missing"
            start = min(int(self.num_computed[slot]), length - 2)
            tokens = states.tokens(slot)
            run_slots.append(slot)
            starts.append(start)
            counts.append(length - 1 - start)
            tok_idx.append(tokens[start + 1 : length])
            feat_slot.extend([slot] * (length - 1 - start))
            feat_pos.extend(range(start, length - 1))
            self.num_computed[slot] = length - 1
        next_tokens = to_device(np.concatenate(tok_idx).astype(np.int64), device)  # [T]
        feat_rows = self.feature_rows(
            np.asarray(feat_slot, np.int64), np.asarray(feat_pos, np.int64)
        )

        def run(
            tokens: slice,
            idx: list[int],
            c_starts: list[int],
            c_counts: list[int],
            rows: np.ndarray,
        ) -> torch.Tensor:
            feats = self.features[feat_rows[tokens]]  # [t, H]
            return self._run(
                [run_slots[j] for j in idx],
                c_starts,
                c_counts,
                self.embed(next_tokens[tokens]),
                feats,
                to_device(rows, device),
            )

        # [A, H]: the predicted hidden after each request's last committed pair
        hidden = forward_in_chunks(
            run, starts, counts, np.cumsum(counts) - 1, self.max_num_batched_tokens or 0
        )
        rows = to_device(active, device)
        positions = [int(states.num_tokens[s]) - 1 for s in run_slots]
        for j in range(kmax):
            logits = self.lm_head(hidden).float()[:, : self.vocab_size]  # [A, V]
            tokens, q = choose_tokens(states, run_slots, logits)
            out[rows, j] = tokens
            if q is not None:
                assert probs is not None
                probs[rows, j] = q
            keep = [n for n, i in enumerate(active) if widths[i] > j + 1]
            if not keep:
                break
            if len(keep) < len(active):  # some requests stop here (a narrower width)
                idx = to_device(keep, device)
                rows, tokens, hidden = rows[idx], tokens[idx], hidden[idx]
                active = [active[n] for n in keep]
                run_slots = [run_slots[n] for n in keep]
                positions = [positions[n] for n in keep]
            positions = [p + (1 if j else 0) for p in positions]
            # the next pair: (predicted hidden, the draft just chosen) one position further on
            hidden = self._run(
                run_slots,
                positions,
                [1] * len(run_slots),
                self.embed(tokens),
                hidden,
                torch.arange(len(run_slots), device=device),
            )
        return Proposal(out, list(widths), probs)
