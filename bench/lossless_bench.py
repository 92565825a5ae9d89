"""Greedy speculative decoding vs target-only greedy on SmolLM2, any device and dtype.

    python bench/lossless_bench.py --model PATH_OR_embedded:smollm2 --device cuda --dtype bfloat16

For each drafter it decodes the prompt mix at batch 1 (one prompt at a time) and at batch N (all at
once) and reports: tokens/s, mean acceptance length, and the share of tokens equal to target-only
greedy (our engine without drafts, same device and dtype): position by position, and as the
matched prefix. Also HF transformers' plain greedy `generate` on the same prompts, for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tokenizers import Tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.prompts import PROMPTS, chat
from tests.driver import Req, run
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.model_loader import load_model
from worker.runner import ModelRunner


def decode(
    model: torch.nn.Module,
    drafter: Drafter,
    prompts: list[list[int]],
    max_tokens: int,
    k: int,
    batch: int,
    mode: str = "off",
) -> tuple[list[list[int]], float, float]:
    """Outputs, tokens/s, mean acceptance length (1 + accepted / steps-with-drafts)."""
    outs: list[list[int]] = []
    tokens = 0
    accepted = spec_steps = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        runner = ModelRunner(
            ModelExecutor(model, max_num_seqs=batch, max_model_len=1024, batch_invariant=mode),
            drafter,
            max_num_seqs=batch,
            max_model_len=1024,
            max_num_draft_tokens=max(k, 1),
        )
        reqs = [Req(f"r{j}", p, max_tokens, k=k) for j, p in enumerate(prompts[i : i + batch])]
        got = run(runner, reqs, max_steps=10_000)
        for r in reqs:
            outs.append(got[r.req_id])
            tokens += len(got[r.req_id])
            accepted += r.accepted
            spec_steps += r.spec_steps
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return outs, tokens / dt, 1 + accepted / max(spec_steps, 1)


def share(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    pos = sum(sum(x == y for x, y in zip(p, q, strict=False)) for p, q in zip(a, b, strict=True))
    total = sum(len(q) for q in b)
    prefix = 0
    for p, q in zip(a, b, strict=True):
        n = 0
        while n < min(len(p), len(q)) and p[n] == q[n]:
            n += 1
        prefix += n
    return pos / total, prefix / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--batch-invariant", default="off", help="off, pad or pad-fp32")
    ap.add_argument("--skip-hf", action="store_true", help="skip the HF generate reference")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    loaded = load_model(args.model, device=device, dtype=dtype)
    tok = Tokenizer.from_file(os.path.join(loaded.directory, "tokenizer.json"))
    prompts = [tok.encode(chat(p)).ids for p in PROMPTS.values()]
    model = loaded.model
    # warm-up
    decode(model, NoDrafter(), prompts[:1], 4, 0, 1)
    rows = []
    results: dict[str, object] = {
        "device": str(device),
        "dtype": str(model.dtype),
        "batch_invariant": args.batch_invariant,
    }
    for batch in (1, len(prompts)):
        mode = args.batch_invariant
        base, base_tps, _ = decode(model, NoDrafter(), prompts, args.max_tokens, 0, batch, mode)
        rows.append(("none", batch, base_tps, 1.0, 1.0, 1.0, 1.0))
        for name, drafter in (("ngram", NgramDrafter(min_n=1, max_n=4, max_num_tokens=args.k)),):
            outs, tps, mean_len = decode(
                model, drafter, prompts, args.max_tokens, args.k, batch, mode
            )
            pos, prefix = share(outs, base)
            rows.append((name, batch, tps, tps / base_tps, pos, prefix, mean_len))
    hf_tps = None
    try:
        if args.skip_hf:
            raise RuntimeError("skipped (--skip-hf)")
        from transformers import AutoModelForCausalLM

        hf = (
            AutoModelForCausalLM.from_pretrained(loaded.directory, dtype=model.dtype)
            .to(device)
            .eval()
        )
        t0 = time.perf_counter()
        n = 0
        hf_outs = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            o = hf.generate(
                ids,
                max_new_tokens=args.max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            hf_outs.append(o)
            n += len(o)
        if device.type == "cuda":
            torch.cuda.synchronize()
        hf_tps = n / (time.perf_counter() - t0)
        base1 = decode(model, NoDrafter(), prompts, args.max_tokens, 0, 1)[0]
        results["hf_vs_specd_none_share"] = share(hf_outs, base1)
    except Exception as e:  # report, do not hide
        results["hf_error"] = repr(e)
    results["hf_generate_tps"] = hf_tps
    results["rows"] = rows
    print(f"batch_invariant={args.batch_invariant} dtype={model.dtype}")
    print(
        "| drafter | batch | tok/s | × none | equal tokens | equal prefix | mean acceptance length |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.2f} | {r[4]:.4f} | {r[5]:.4f} | {r[6]:.2f} |"
        )
    print(
        f"HF generate (greedy, batch 1): {hf_tps and round(hf_tps, 1)} tok/s; "
        f"HF vs specd-none equal share: {results.get('hf_vs_specd_none_share')}"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
