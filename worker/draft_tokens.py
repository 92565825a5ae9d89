"""``DraftTokensHandler``: hands each step's drafts to the transport, copying them to the host only
when the scheduler must validate them against a grammar.

Who calls what: the runner calls ``begin_step`` before a step, ``discard`` for requests that left,
and ``set_draft_tokens`` after the drafter proposed; the transport calls ``get_draft_tokens`` once
per step, after sending the step's ``ModelRunnerOutput`` and letting the drafter run (a step that
proposes nothing sends none to a scheduler of protocol minor 6 or later: ``drafts_follow``,
``ModelRunner.will_propose``). Nothing else
touches its stream, event or host buffers.

On CUDA the device-to-host copy runs on a side stream into pinned memory and ``get_draft_tokens``
waits on a blocking event (it sleeps instead of spinning on the driver lock). On CPU the copy is a
plain synchronous one. Batches without a structured request copy nothing: their requests get
width-only placeholders (``-1`` repeated width times) and the real ids stay on the device, where
the runner reads them next step. In a structured batch the unstructured requests get placeholders
too: only grammar-bound drafts need the trip.
"""

from __future__ import annotations

import numpy as np
import torch

from protocol.messages import DraftTokenIds


class DraftTokensHandler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy_event = torch.cuda.Event(blocking=True) if device.type == "cuda" else None
        self.step_id = -1
        self.deferred_req_ids: frozenset[str] = frozenset()
        self._req_ids: list[str] = []
        self._num_drafts = np.zeros(0, np.int32)
        self._num_committed = np.zeros(0, np.int32)
        self._structured = np.zeros(0, bool)
        self._draft_np: np.ndarray | None = None  # [num_reqs, K] host rows, structured batches only
        self._pending = False

    def begin_step(self, step_id: int, deferred_req_ids: frozenset[str] = frozenset()) -> None:
        """Start ``step_id``. Deferred requests (their sampling waits for a later bitmask in overlap
        mode) get no drafts in this step's message: their drafts are not final yet."""
        self.step_id = step_id
        self.deferred_req_ids = deferred_req_ids
        self._pending = False

    def discard(self, req_ids: list[str]) -> None:
        """Forget drafts of requests that finished or were aborted; they are never sent."""
        if not self._pending or not req_ids:
            return
        gone = set(req_ids)
        keep = [i for i, r in enumerate(self._req_ids) if r not in gone]
        if len(keep) == len(self._req_ids):
            return
        self._select(keep)

    def set_draft_tokens(
        self,
        req_ids: list[str],
        draft_tokens: torch.Tensor,
        num_drafts: np.ndarray,
        num_committed: np.ndarray,
        structured: np.ndarray,
    ) -> None:
        """draft_tokens [num_reqs, K] on the device; num_drafts, num_committed, structured [num_reqs]."""
        self._req_ids = list(req_ids)
        self._num_drafts = num_drafts.astype(np.int32)
        self._num_committed = num_committed.astype(np.int32)
        self._structured = structured.astype(bool)
        self._pending = True
        self._draft_np = None
        if not self._structured.any() or not self._num_drafts.any():
            return  # widths only (or no drafts at all): nothing crosses to the host
        if self.copy_stream is None:
            self._draft_np = draft_tokens.to(torch.int32).numpy()
            return
        main = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(main)
        with torch.cuda.stream(self.copy_stream):
            host = torch.empty(draft_tokens.shape, dtype=torch.int32, pin_memory=True)
            src = draft_tokens.to(torch.int32)
            host.copy_(src, non_blocking=True)
            # draft_tokens (and its int32 copy) are temporaries of the main stream read here on
            # copy_stream; without record_stream, the caching allocator may reuse their memory
            # before the async copy executes.
            draft_tokens.record_stream(self.copy_stream)
            src.record_stream(self.copy_stream)
            assert self.copy_event is not None
            self.copy_event.record()
        self._draft_np = host.numpy()

    def get_draft_tokens(self) -> DraftTokenIds | None:
        """This step's ``DraftTokenIds``, or None when no drafts were set (or all were discarded)."""
        if not self._pending:
            return None
        self._pending = False
        if self.deferred_req_ids:
            self._select([i for i, r in enumerate(self._req_ids) if r not in self.deferred_req_ids])
        widths = self._num_drafts
        flat = np.full(int(widths.sum()), -1, np.int32)
        if self._draft_np is not None:
            if self.copy_event is not None:
                self.copy_event.synchronize()
            off = 0
            for i, w in enumerate(widths.tolist()):
                if self._structured[i]:
                    flat[off : off + w] = self._draft_np[i, :w]
                off += w
        return DraftTokenIds(
            step_id=self.step_id,
            req_ids=self._req_ids,
            num_draft_tokens=widths,
            draft_token_ids=flat,
            num_committed_tokens=self._num_committed,
        )

    def _select(self, keep: list[int]) -> None:
        self._req_ids = [self._req_ids[i] for i in keep]
        self._num_drafts = self._num_drafts[keep]
        self._num_committed = self._num_committed[keep]
        self._structured = self._structured[keep]
        if self._draft_np is not None:
            self._draft_np = self._draft_np[keep]
