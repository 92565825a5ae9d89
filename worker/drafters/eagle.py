"""The EAGLE-style drafter: a trained head (``worker/eagle_head.py``) on the target's hidden states.

Per request the head keeps its own KV cache over the pairs (f_t, x_{t+1}) of the committed sequence:
f_t is the target's hidden state at position t (given by the runner through ``observe`` once the
position is committed), x_{t+1} the next committed token. With L committed tokens the target has
given f_0 .. f_{L-2}; ``propose`` first catches the head up to pair L-2 (ragged forwards of at most
the worker's token budget, for every request at once), whose output predicts f_{L-1} and, through
the target's LM head, draft 1. Each further draft feeds back (predicted hidden, previous draft).
Draft pairs sit past the committed pairs in the head's cache and are dropped by keeping its length
at L-1. The head's cache and the store of f_t are paged like the target's (``bind``).

Where the paged kernel runs, greedy drafting is one padded layout (``eagle_graphs.py``),
replayed from a CUDA graph on GPU. Requests that sample, and catch-ups longer than k + 1 pairs,
run the ragged path here, whose catch-up forwards replay ``RaggedGraphs`` per token bucket there
(a backlog builds up while the tuner keeps drafting at zero: eagerly, the step that drafts again
paid several forwards for it).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.attention import (
    ATTN_IMPLEMENTATION,
    PagedMetadata,
    build_dense_metadata,
    build_metadata,
)
from worker.block_table import BlockTable
from worker.drafters.base import Drafter, Proposal, choose_tokens, proposal_buffers
from worker.drafters.catch_up import forward_in_chunks
from worker.drafters.eagle_graphs import EagleGraphs
from worker.eagle_head import EagleHead
from worker.fused_layers import FusedDecoder
from worker.host_copy import to_device
from worker.kv_cache import KVCache, draft_num_blocks
from worker.model_executor import ModelExecutor
from worker.paged_kernel import use_kernel
from worker.ragged_graphs import RaggedGraphs
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
        dense: bool | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        """``max_num_tokens``: the most drafts a request proposes; ``max_num_batched_tokens``:
        the most pairs one catch-up forward of the head runs (None: the target's token budget,
        its executor's ``max_num_tokens``). ``dense``: greedy drafting in the padded layout of
        ``eagle_graphs.py`` (None: on CUDA with the paged kernel), replayed from CUDA graphs
        unless ``cuda_graphs`` is False."""
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
        # default: where the paged kernel runs (its work follows each token's own position; the
        # portable attention would gather every request's keys up to max_model_len each forward)
        self.dense = self.device.type == "cuda" and self.kernel if dense is None else dense
        self.cuda_graphs = cuda_graphs
        self._graphs: EagleGraphs | None = None  # made in ``bind`` (it needs the head's cache)
        self._ragged: RaggedGraphs | None = None  # the catch-up's, made in ``bind`` too

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
        if self.dense and self.max_num_tokens:
            self._graphs = EagleGraphs(
                self._dense_drafts,
                self._kv_cache,
                width=self.max_num_tokens + 1,
                max_drafts=self.max_num_tokens,
                device=self.device,
                use_graphs=self.cuda_graphs,
            )
        if self.kernel and self.fused is not None:
            self._ragged = RaggedGraphs(
                self._ragged_backbone,
                self._kv_cache,
                max_tokens=self.max_num_batched_tokens,
                device=self.device,
                use_graphs=self.cuda_graphs,
            )

    def capture_all(self) -> int:
        """Capture every drafting and catch-up graph now (the service does, before the first
        request); returns how many."""
        n = self._graphs.capture_all() if self._graphs is not None else 0
        return n + (self._ragged.capture_all() if self._ragged is not None else 0)

    def _ragged_backbone(
        self, pairs: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        """``RaggedGraphs``' backbone: ``pairs`` [T] holds each pair's two indices in one int64
        (the graphs carry one index per token), feature row * vocab + next token."""
        v = self.embed.num_embeddings
        return self._forward(self.embed(pairs % v), self.features[pairs // v], positions, meta)

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
        cuda_graphs: bool = True,
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
            cuda_graphs=cuda_graphs,
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

    def _forward(
        self,
        embeds: torch.Tensor,
        feats: torch.Tensor,
        positions: torch.Tensor,
        meta: PagedMetadata,
    ) -> torch.Tensor:
        """The head over flat pairs: embeddings and features [T, H], positions [T] -> [T, H]."""
        if self.fused is not None:
            return self.fused.forward_embeds(self.head.inputs(embeds, feats), positions, meta)
        out = self.head(
            embeds[None],
            feats[None],
            positions[None],
            attention_mask=self._placeholder_mask,
            specd_meta=meta,
        )  # [1, T, H]
        return out[0]

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
        return self._forward(embeds, feats, positions, meta)[last_rows]

    def _dense_drafts(
        self,
        tokens: torch.Tensor,
        feature_rows: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        slot_idx: torch.Tensor,
        last: torch.Tensor,
        draft_positions: torch.Tensor,
        draft_slot_mapping: torch.Tensor,
        num_reqs: int,
        width: int,
        num_drafts: int,
    ) -> torch.Tensor:
        """``EagleGraphs``' body: every tensor is a static buffer (graph-safe). The catch-up of
        ``num_reqs`` requests of ``width`` pairs, then ``num_drafts`` argmax drafts each:
        [num_reqs, num_drafts]."""

        def meta(pos: torch.Tensor, rows: torch.Tensor, w: int) -> PagedMetadata:
            return build_dense_metadata(
                self.kv_cache,
                pos,
                rows,
                slot_idx,
                num_reqs=num_reqs,
                width=w,
                max_len=self.max_model_len,
                query_rows=0,
                fp32=False,
                kernel=self.kernel,
            )

        hidden = self._forward(
            self.embed(tokens),
            self.features[feature_rows],
            positions,
            meta(positions, slot_mapping, width),
        )[last]  # [B, H]
        drafts = []
        for j in range(num_drafts):
            picked = self.lm_head(hidden).float()[:, : self.vocab_size].argmax(-1)  # [B]
            drafts.append(picked)
            if j + 1 < num_drafts:
                rows = slice(j * num_reqs, (j + 1) * num_reqs)
                pos = draft_positions[rows]
                hidden = self._forward(
                    self.embed(picked), hidden, pos, meta(pos, draft_slot_mapping[rows], 1)
                )
        return torch.stack(drafts, dim=1)

    def _pairs(
        self, states: RequestStates, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The pairs (f_t, x_{t+1}) for t = starts[i] .. starts[i] + counts[i] - 1, flat and
        request-major: x_{t+1} [T] and the feature store's rows of f_t [T]."""
        assert self._target_blocks is not None, "EagleDrafter.bind(target) first"
        owner = np.repeat(slots, counts)
        t = flat_ranges(starts, counts)
        return states.token_ids[owner, t + 1].astype(np.int64), self._target_blocks.cache_rows(
            owner, t
        )

    def _catch_up(
        self,
        states: RequestStates,
        slots: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        want_last: bool,
    ) -> torch.Tensor:
        """Ragged head forwards over the pairs of ``_pairs`` (in chunks of the token budget);
        the predicted hidden after each request's last pair [n, H] (``want_last``; else [0, H])."""
        tokens_np, rows_np = self._pairs(states, slots, starts, counts)
        next_tokens = to_device(tokens_np, self.device)  # [T]
        feat_rows = to_device(rows_np, self.device)  # [T]
        run_slots = slots.tolist()

        ragged = self._ragged
        # [T] both indices of each pair in one int64, as the ragged graphs' backbone reads them
        pairs = feat_rows * self.embed.num_embeddings + next_tokens if ragged is not None else None

        def run(
            tokens: slice,
            idx: list[int],
            c_starts: list[int],
            c_counts: list[int],
            rows: np.ndarray,
        ) -> torch.Tensor:
            chunk_slots = [run_slots[j] for j in idx]
            total = tokens.stop - tokens.start
            if ragged is not None and pairs is not None and ragged.fits(total, len(idx)):
                ends = [s + c for s, c in zip(c_starts, c_counts, strict=True)]
                self.kv_cache.allocate(chunk_slots, ends)
                out = ragged.forward(pairs[tokens], chunk_slots, c_starts, c_counts)
                return out[to_device(rows, self.device)]
            return self._run(
                chunk_slots,
                c_starts,
                c_counts,
                self.embed(next_tokens[tokens]),
                self.features[feat_rows[tokens]],
                to_device(rows, self.device),
            )

        last = np.cumsum(counts) - 1 if want_last else np.zeros(0, np.int64)
        return forward_in_chunks(
            run, starts.tolist(), counts.tolist(), last, self.max_num_batched_tokens or 0
        )

    @torch.inference_mode()
    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        device = self.device
        kmax = max(widths, default=0)
        active, out, probs = proposal_buffers(states, slots, widths, self.vocab_size, device)
        sampled = probs is not None
        if not active:
            return Proposal(out, [0] * len(slots), probs)
        # Catch up: pairs (f_t, x_{t+1}) for t = num_computed .. L-2 of every active request.
        run_np = np.asarray([slots[i] for i in active], np.int64)
        lengths = states.num_tokens[run_np].astype(np.int64)
        assert (self.num_features[run_np] >= lengths - 1).all(), "target hidden states missing"
        starts = np.minimum(self.num_computed[run_np], lengths - 2)
        self.num_computed[run_np] = lengths - 1
        graphs = self._graphs
        if graphs is not None and not sampled:
            # the backlog past the layout's width first, then one padded step (eagle_graphs.py)
            counts = lengths - 1 - starts
            over = counts > graphs.width
            if over.any():
                self._catch_up(
                    states, run_np[over], starts[over], counts[over] - graphs.width, False
                )
                starts = np.where(over, lengths - 1 - graphs.width, starts)
            # blocks for the last draft forward's position, lengths + kmax - 3 (none past the end)
            ends = np.minimum(lengths + max(kmax - 2, -1), self.max_model_len)
            self.kv_cache.allocate(run_np.tolist(), ends.tolist())
            tokens, rows = self._pairs(states, run_np, starts, lengths - 1 - starts)
            drafts = graphs.drafts(run_np, starts, lengths, tokens, rows, kmax)  # [A, kmax]
            if len(active) == len(slots):
                return Proposal(drafts, list(widths), None)
            out[to_device(active, device)] = drafts
            return Proposal(out, list(widths), None)
        # [A, H]: the predicted hidden after each request's last committed pair
        hidden = self._catch_up(states, run_np, starts, lengths - 1 - starts, True)
        run_slots = run_np.tolist()
        rows = to_device(active, device)
        positions = (lengths - 1).tolist()
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
