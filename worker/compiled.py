"""torch.compile for the decoder layers around attention (``--enable-torch-compile``).

A small model's decode step is launch-bound: HF's RMSNorm, rotary embedding, SiLU-and-multiply and
residual adds are a dozen separate kernels per layer for a few kilobytes of data each. Compiling
each decoder layer fuses them into a handful of Triton (GPU) or C++ (CPU) kernels. Attention stays
out of the compiled graphs (attention.py registers it under ``torch.compiler.disable``: the KV
cache is written in place, and the ragged path loops over requests), so each layer compiles into the part before attention and the
part after it. Every layer runs the same code, so one compiled graph per shape class serves all of
them; token counts are dynamic after the first recompile.

Only decode-shaped forwards (``decode_graphs.py``) run compiled: on GPU they are captured into CUDA
graphs, so the compiled frames' guard checks are paid at capture and never at replay. Prefill runs
the plain layers, which never pay them: a compiled 40-token prefill of a narrow 30-layer model took
11.3 ms against 8.8 ms plain on the 2-core CPU machine (``bench/step_profile.py --prefill-check``).

The compiled kernels round differently from eager ones. Speculative and no-draft decode steps both
run compiled, so their outputs stay equal token for token (pad mode on GPU, float32 on CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch._dynamo
from transformers import PreTrainedModel

log = logging.getLogger("specd.worker")


class CompiledLayers:
    """The compiled forwards of one model's decoder layers and final norm; ``active()`` puts them
    in place for the forwards run inside it. One per model (``for_model``), shared by every
    executor that runs it."""

    def __init__(self, model: PreTrainedModel) -> None:
        # Batch buckets x widths x context buckets meet several shape classes (sizes 0/1
        # specialise); the default of 8 cached graphs per code object would fall back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 1024
        )
        backbone = model.get_decoder()
        self.modules: list[torch.nn.Module] = [*backbone.layers, backbone.norm]
        self.forwards = [torch.compile(m.forward) for m in self.modules]
        log.info("torch.compile: %d decoder modules compile on first use", len(self.modules))

    @staticmethod
    def for_model(model: PreTrainedModel) -> CompiledLayers:
        found = getattr(model, "_specd_compiled_layers", None)
        if found is None:
            found = CompiledLayers(model)
            model._specd_compiled_layers = found  # type: ignore[assignment]
        return found  # type: ignore[no-any-return]

    @contextmanager
    def active(self) -> Iterator[None]:
        for module, forward in zip(self.modules, self.forwards, strict=True):
            module.forward = forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            for module in self.modules:
                del module.forward  # back to the class's own forward
