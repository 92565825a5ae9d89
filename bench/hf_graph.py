"""The plain-HF ceiling the served path is measured against: transformers' own decode step over a
``StaticCache``, replayed from one CUDA graph (on CPU, the same step eagerly: a check, not a figure).

    python bench/hf_graph.py --model embedded:smollm2 --batches 1 64 --context 256

One graphed step does everything a greedy decode step needs: it marks the new position in a static
4-D attention mask, runs the model over the static cache at ``cache_position``, takes the argmax and
writes it back as the next input, then moves the position. Replaying it ``--steps`` times decodes
that many tokens with no host work between steps. The model is loaded as specd loads it
(``worker.model_loader``, so ``--load-format dummy`` works) and switched to transformers' ``sdpa``
attention. Before timing, the graphed tokens are checked against transformers' ``generate`` at
batch 1 (greedy, same model): a step that decodes wrongly would time the wrong thing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from transformers import StaticCache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class GraphedDecode:
    """Greedy decoding of ``batch`` sequences of ``context`` prompt tokens over a StaticCache."""

    def __init__(self, model: Any, prompt: torch.Tensor, steps: int, graph: bool) -> None:
        batch, context = prompt.shape  # [B, context]
        device = prompt.device
        self.model, self.steps = model, steps
        length = context + steps + 1
        self.cache = StaticCache(config=model.config, max_cache_len=length)
        with torch.inference_mode():
            logits = model(
                input_ids=prompt,
                past_key_values=self.cache,
                cache_position=torch.arange(context, device=device),
                use_cache=True,
            ).logits  # [B, context, vocab]
        self.ids = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1] the first new token
        self.pos = torch.tensor([context], device=device)  # [1] where self.ids goes
        self.mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=device)
        self.mask[..., :context] = True
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm-up on a side stream, as torch.cuda.graphs asks
                    self._step(commit=False)
            torch.cuda.current_stream().wait_stream(stream)
        self._rewind(context)  # a no-op without the warm-ups (CPU): run there too, as a check
        if graph:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self._step(commit=True)

    @torch.inference_mode()  # the cache's tensors were made in inference mode
    def _rewind(self, length: int) -> None:
        """Set the cache's own write position back to ``length`` after the warm-up steps.

        transformers 5's static layers ignore ``cache_position`` when writing: each keeps a
        device counter (``cumulative_length``) that every forward advances. The warm-ups moved it
        past the prompt, so replays would write further on each time until ``index_copy_`` ran
        off the end of the cache (a device-side assert on the H200). The captured step advances
        the counter with ``pos``, so one rewind keeps them together."""
        for layer in getattr(self.cache, "layers", ()):
            for name in ("cumulative_length", "indexer_cumulative_length"):
                counter = getattr(layer, name, None)
                if isinstance(counter, torch.Tensor):
                    counter.fill_(length)
            if isinstance(getattr(layer, "cumulative_length_int", None), int):
                layer.cumulative_length_int = length  # sliding-window layers' host copy

    def _step(self, *, commit: bool) -> None:
        self.mask.index_fill_(-1, self.pos, True)
        logits = self.model(
            input_ids=self.ids,
            position_ids=self.pos[None].expand(self.ids.shape[0], 1),
            cache_position=self.pos,
            past_key_values=self.cache,
            attention_mask=self.mask,
            use_cache=True,
        ).logits  # [B, 1, vocab]
        if commit:
            self.ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
            self.pos.add_(1)

    def run(self) -> list[list[int]]:
        """Decode ``steps`` tokens; returns each sequence's tokens (the prefill's first included)."""
        out = [self.ids.clone()]
        for _ in range(self.steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                with torch.inference_mode():
                    self._step(commit=True)
            out.append(self.ids.clone())
        return torch.cat(out, dim=1).tolist()


def measure(model: Any, batch: int, context: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """ms per graphed decode step at ``batch`` x ``context`` (random prompt tokens)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
    graph = device.type == "cuda"
    dec = GraphedDecode(model, prompt, steps, graph)
    if graph:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dec.run()
    if graph:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / steps
    return {"batch": batch, "context": context, "steps": steps, "graph": graph, "step_ms": ms}


def check_against_generate(model: Any, context: int, steps: int) -> None:
    """The graphed loop's tokens equal transformers' greedy ``generate`` at batch 1."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    ours = GraphedDecode(model, prompt, steps, device.type == "cuda").run()[0]
    with torch.inference_mode():
        ref = model.generate(
            prompt, max_new_tokens=steps + 1, do_sample=False, min_new_tokens=steps + 1
        )[0, context:].tolist()
    if ours != ref:
        raise SystemExit(f"graphed HF decode differs from generate: {ours} vs {ref}")


def load_sdpa(spec: str, device: torch.device, dtype: torch.dtype | None, load_format: str) -> Any:
    from worker.model_loader import load_model

    model = load_model(spec, device=device, dtype=dtype, load_format=load_format).model
    model.set_attn_implementation("sdpa")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_sdpa(a.model, device, getattr(torch, a.dtype) if a.dtype else None, a.load_format)
    check_against_generate(model, min(a.context, 32), 16)
    rows = [measure(model, b, a.context, a.steps) for b in a.batches]
    for r in rows:
        print(json.dumps(r), flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
