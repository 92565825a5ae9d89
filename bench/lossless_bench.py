"""(a, b, d) specd with and without speculation on SmolLM2, HF transformers on the same prompts, and
the batch-1 decode step against its floors. Any device and dtype.

    python bench/lossless_bench.py --model PATH_OR_embedded:smollm2 --device cuda --dtype bfloat16 \
        --batches 1 8 64 --max-tokens 128 --json-out out.json

(a) For each batch size the prompt mix (edit tasks, JSON, open chat; repeated to fill the batch) is
decoded without drafts and with n-gram drafts: tokens/s, mean acceptance length, acceptance per
position, and the share of tokens equal to the no-draft output (position by position and as matched
prefix), per prompt kind at batch 1; tokens per decode step (every decode step counted, those where
the drafter found nothing too), the decode-phase speedup, and the ideal that acceptance allows
(tokens per decode step over the no-draft run's, times 1 - drafting share). Requests end at the
model's end of turn or at --max-tokens (--ignore-eos: always --max-tokens). (b) HF `generate` plain
and with prompt lookup at batch 1, same stops. (d) The batch-1 no-draft decode step against the
weight-streaming floor (weight bytes / measured HBM bandwidth) and against replaying the step's CUDA
graph alone. Every configuration runs once untimed first (graph capture, allocator), then timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from tokenizers import Tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.prompts import PROMPTS, chat
from scheduler_client.spec_tuner import SpeculationTuner
from tests.driver import Req, run
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.model_loader import eos_token_ids, load_model
from worker.runner import ModelRunner

MAX_LEN = 1024


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_runner(
    model: torch.nn.Module,
    drafter: Drafter,
    k: int,
    batch: int,
    mode: str,
    graphs: bool,
    compile_layers: bool = False,
) -> ModelRunner:
    return ModelRunner(
        ModelExecutor(
            model,
            max_num_seqs=batch,
            max_model_len=MAX_LEN,
            batch_invariant=mode,
            decode_width=1 + k,
            cuda_graphs=graphs,
            compile_layers=compile_layers,
        ),
        drafter,
        max_num_seqs=batch,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=max(k, 1),
    )


def make_drafter(
    name: str,
    k: int,
    model: torch.nn.Module,
    batch: int,
    eagle_head: str | None,
    draft: torch.nn.Module | None = None,
    mode: str = "off",
    graphs: bool = False,
) -> Drafter:
    """``name``: ngram, eagle (with ``eagle_head``) or draft_model (with the loaded ``draft``,
    run as the worker runs it: its own executor and KV cache, in ``mode``, graphed or not)."""
    if k == 0:
        return NoDrafter()
    if name.startswith("eagle"):
        from worker.drafters.eagle import EagleDrafter

        assert eagle_head is not None
        return EagleDrafter.from_files(
            eagle_head,
            model,
            max_num_seqs=batch,
            max_model_len=MAX_LEN,
            max_num_tokens=k,
            cuda_graphs=graphs,
        )
    if name == "draft_model":
        from worker.drafters.draft_model import DraftModelDrafter

        assert draft is not None, "the draft_model drafter needs its draft model"
        executor = ModelExecutor(
            draft,
            max_num_seqs=batch,
            max_model_len=MAX_LEN,
            batch_invariant=mode,
            decode_width=1 + k,
            cuda_graphs=graphs,
        )
        vocab = int(model.config.get_text_config().vocab_size)
        return DraftModelDrafter(executor, max_num_tokens=k, target_vocab_size=vocab)
    return NgramDrafter(min_n=1, max_n=4, max_num_tokens=k)


def drafter_share(runner: ModelRunner, reqs: list[Req], tuner: SpeculationTuner | None) -> float:
    """Share of a run's time spent proposing drafts, each call fenced by device syncs (an untimed
    extra pass: the fences cost overlap, so the timed pass never has them)."""
    propose = runner.drafter.propose
    spent = [0.0]

    def fenced(*args: Any, **kwargs: Any) -> Any:
        sync()
        t = time.perf_counter()
        out = propose(*args, **kwargs)
        sync()
        spent[0] += time.perf_counter() - t
        return out

    runner.drafter.propose = fenced  # type: ignore[method-assign]
    try:
        sync()
        t0 = time.perf_counter()
        run(runner, reqs, 100_000, tuner)
        sync()
        return spent[0] / (time.perf_counter() - t0)
    finally:
        del runner.drafter.propose


def decode(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_tokens: int,
    k: int,
    tuner: SpeculationTuner | None = None,
    stop_ids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """All prompts at once (the runner's slots are the batch); an untimed pass first. A request
    ends at ``max_tokens`` or at its first stop id (the model's end of turn), as a user's does."""
    runner.target.decode.capture_all(max(len(p) for p in prompts) + max_tokens + k + 1)
    warm = [Req(f"w{j}", p, max_tokens, k=k, stop_ids=stop_ids) for j, p in enumerate(prompts)]
    run(runner, warm, 100_000, tuner)
    fenced = [Req(f"f{j}", p, max_tokens, k=k, stop_ids=stop_ids) for j, p in enumerate(prompts)]
    draft_share = drafter_share(runner, fenced, tuner) if k else 0.0
    reqs = [Req(f"r{j}", p, max_tokens, k=k, stop_ids=stop_ids) for j, p in enumerate(prompts)]
    sync()
    t0 = time.perf_counter()
    log: list[tuple[float, bool, int]] = []
    got = run(runner, reqs, max_steps=100_000, tuner=tuner, step_log=log)
    sync()
    dt = time.perf_counter() - t0
    decode = [(s, n) for s, prefill, n in log if not prefill]
    tokens = sum(len(v) for v in got.values())
    spec_steps = sum(r.spec_steps for r in reqs)
    width = max((len(r.drafted_at) for r in reqs), default=0)
    drafted = [sum(r.drafted_at[i] for r in reqs if i < len(r.drafted_at)) for i in range(width)]
    accepted = [sum(r.accepted_at[i] for r in reqs if i < len(r.accepted_at)) for i in range(width)]
    return {
        "outs": [got[r.req_id] for r in reqs],
        "tps": tokens / dt,
        # decode steps only (no prompt tokens in them): seconds, steps, tokens sampled
        "decode": (sum(s for s, _ in decode), len(decode), sum(n for _, n in decode)),
        "mean_len": 1 + sum(r.accepted for r in reqs) / max(spec_steps, 1),
        # every sampling step counts, those where the drafter found nothing too
        "tokens_per_step": sum(len(r.out) for r in reqs)
        / max(sum(r.sample_steps for r in reqs), 1),
        "draft_step_share": spec_steps / max(sum(r.sample_steps for r in reqs), 1),
        "per_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)],
        "drafter_share": draft_share,
    }


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


def floors(model: torch.nn.Module, runner: ModelRunner, step_s: float) -> dict[str, float]:
    """(d): the measured batch-1 decode step vs weight bytes / HBM bandwidth and vs graph replay."""
    out: dict[str, float] = {"step_ms": step_s * 1e3}
    if not torch.cuda.is_available():
        return out
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    sync()
    bandwidth = 2 * x.numel() * 20 / (time.perf_counter() - t0)  # read + write
    del x, y
    out["hbm_gb_s"] = bandwidth / 1e9
    out["weight_floor_ms"] = weight_bytes / bandwidth * 1e3
    graphs = runner.target.decode
    shape = next((s for (b, w, _), s in sorted(graphs._shapes.items()) if b == 1 and w == 1), None)
    if shape is not None and shape.graph is not None:
        shape.graph.replay()
        sync()
        t0 = time.perf_counter()
        for _ in range(200):
            shape.graph.replay()
        sync()
        out["graph_replay_ms"] = (time.perf_counter() - t0) / 200 * 1e3
        out["step_over_replay"] = out["step_ms"] / out["graph_replay_ms"]
    out["step_over_weight_floor"] = out["step_ms"] / out["weight_floor_ms"]
    return out


def hf_reference(
    directory: str,
    dtype: torch.dtype,
    device: torch.device,
    prompts: list[list[int]],
    max_tokens: int,
    k: int,
    stop_ids: tuple[int, ...],
) -> dict[str, Any]:
    """(b) HF generate at batch 1: plain greedy, and prompt-lookup assisted; the same stop ids as
    specd's runs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    res: dict[str, Any] = {}
    for name, extra in (("plain", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": k})):
        outs, n = [], 0
        for _ in range(2):  # the first pass warms up
            sync()
            t0 = time.perf_counter()
            outs, n = [], 0
            for p in prompts:
                ids = torch.tensor([p], device=device)
                o = hf.generate(
                    ids,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=list(stop_ids) or None,
                    pad_token_id=0,
                    **extra,
                )[0, len(p) :].tolist()
                outs.append(o)
                n += len(o)
            sync()
            dt = time.perf_counter() - t0
        res[name] = {"tps": n / dt, "outs": outs}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 6])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--batch-invariant", default="off", help="off, pad or pad-fp32")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile the decoder layers (compiled.py)"
    )
    ap.add_argument("--skip-hf", action="store_true", help="skip the HF generate reference")
    ap.add_argument("--eagle-head", default=None, help="also rows for this EAGLE head (DIR)")
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="decode exactly --max-tokens (past the end of turn, as sessions 2-3 measured)",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    loaded = load_model(args.model, device=device, dtype=dtype)
    tok = Tokenizer.from_file(os.path.join(loaded.directory, "tokenizer.json"))
    kinds = list(PROMPTS)
    base_prompts = [tok.encode(chat(p)).ids for p in PROMPTS.values()]
    model = loaded.model
    stop_ids = () if args.ignore_eos else eos_token_ids(model)
    graphs = not args.enforce_eager
    mode = args.batch_invariant
    results: dict[str, Any] = {
        "device": str(device),
        "dtype": str(model.dtype),
        "batch_invariant": mode,
        "cuda_graphs": graphs,
        "compiled": args.compile,
        "stop_ids": list(stop_ids),
        "rows": [],
    }
    rows = results["rows"]
    for batch in args.batches:
        prompts = [
            base_prompts[i % len(base_prompts)] for i in range(max(batch, len(base_prompts)))
        ]
        # batch 1: one request at a time through one runner; batch N: N at once
        groups = (
            [[p] for p in prompts]
            if batch == 1
            else [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        )
        per: dict[str, dict[str, Any]] = {}
        configs = [("none", 0), ("ngram", args.k), ("ngram+adaptive", args.k)]
        if args.eagle_head:
            configs += [("eagle", args.k), ("eagle+adaptive", args.k)]
        for name, k in configs:
            drafter = make_drafter(name, k, model, batch, args.eagle_head, None, mode, graphs)
            runner = make_runner(model, drafter, k, batch, mode, graphs, args.compile)
            tuner = SpeculationTuner(k) if name.endswith("adaptive") else None
            parts = [decode(runner, g, args.max_tokens, k, tuner, stop_ids) for g in groups]
            tokens = sum(sum(len(o) for o in p["outs"]) for p in parts)
            seconds = sum(sum(len(o) for o in p["outs"]) / p["tps"] for p in parts)
            per[name] = {
                "outs": [o for p in parts for o in p["outs"]],
                "tps": tokens / seconds,
                "parts": parts,
                "mean_len": sum(p["mean_len"] for p in parts) / len(parts),
                "per_position": [
                    sum(p["per_position"][i] for p in parts if i < len(p["per_position"]))
                    / max(1, sum(i < len(p["per_position"]) for p in parts))
                    for i in range(args.k)
                ],
                "runner": runner,
                "drafter_share": sum(p["drafter_share"] for p in parts) / len(parts),
                "tokens_per_step": sum(p["tokens_per_step"] for p in parts) / len(parts),
                "draft_step_share": sum(p["draft_step_share"] for p in parts) / len(parts),
                "decode": [sum(p["decode"][i] for p in parts) for i in range(3)],
            }
        base = per["none"]
        for name in per:
            r = per[name]
            pos, prefix = share(r["outs"], base["outs"])
            row = {
                "drafter": name,
                "batch": batch,
                "tps": r["tps"],
                "x_none": r["tps"] / base["tps"],
                "equal_tokens": pos,
                "equal_prefix": prefix,
                "mean_acceptance_length": r["mean_len"] if name != "none" else 1.0,
                "acceptance_per_position": r["per_position"] if name != "none" else [],
                "drafter_share_of_time": r["drafter_share"],
                "tokens_per_step": r["tokens_per_step"],
                "draft_step_share": r["draft_step_share"],
                "tokens": sum(len(o) for o in r["outs"]),
                "decode_seconds_steps_tokens": r["decode"],
                "decode_step_ms": 1e3 * r["decode"][0] / max(r["decode"][1], 1),
                "decode_tokens_per_step": r["decode"][2] / max(r["decode"][1], 1),
            }
            # The ideal the measured acceptance allows, in the decode phase (prefill steps are
            # the same work with or without drafts): the tokens a decode step yields, every
            # decode step counted (those where the drafter found nothing too), at the cost of a
            # plain step plus the drafting; of ideal = the decode-phase speedup over that. Exact
            # at batch 1; at larger batches requests end at different steps, so it is a guide.
            base_dec = base["decode"]
            dec_speedup = (r["decode"][2] / r["decode"][0]) / (base_dec[2] / base_dec[0])
            row["decode_x_none"] = dec_speedup
            row["ideal"] = (row["decode_tokens_per_step"] / (base_dec[2] / max(base_dec[1], 1))) * (
                1 - r["drafter_share"]
            )
            row["of_ideal"] = dec_speedup / row["ideal"]
            if batch == 1:
                row["per_kind_x_none"] = {
                    kinds[i]: r["parts"][i]["tps"] / base["parts"][i]["tps"]
                    for i in range(len(kinds))
                }
            rows.append(row)
        if batch == 1:
            # the decode steps of every prompt (a prefill step is not the shape being replayed)
            dec_s, dec_n, _ = base["decode"]
            results["floors"] = floors(model, base["runner"], dec_s / max(dec_n, 1))
            spec1 = per["ngram"]["tps"]
            results["specd_batch1_tps"] = {"none": base["tps"], "ngram": spec1}
        del per
    if not args.skip_hf:
        try:
            hf = hf_reference(
                loaded.directory,
                model.dtype,
                device,
                base_prompts,
                args.max_tokens,
                args.k,
                stop_ids,
            )
            results["hf"] = {
                "plain_tps": hf["plain"]["tps"],
                "prompt_lookup_tps": hf["prompt_lookup"]["tps"],
                "prompt_lookup_equal_to_plain": share(
                    hf["prompt_lookup"]["outs"], hf["plain"]["outs"]
                )[0],
            }
            s1 = results.get("specd_batch1_tps", {})
            if s1:
                results["hf"]["specd_ngram_over_hf_plain"] = s1["ngram"] / hf["plain"]["tps"]
                results["hf"]["specd_ngram_over_hf_prompt_lookup"] = (
                    s1["ngram"] / hf["prompt_lookup"]["tps"]
                )
        except Exception as e:  # report, do not hide
            results["hf_error"] = repr(e)
    print(
        f"batch_invariant={mode} dtype={model.dtype} cuda_graphs={graphs} compiled={args.compile}"
    )
    print(
        "| drafter | batch | tok/s | × none | equal tokens | equal prefix | mean acceptance length "
        "| drafting share | tokens per step | steps with drafts | decode step ms "
        "| decode × none | ideal | of ideal |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['drafter']} | {r['batch']} | {r['tps']:.1f} | {r['x_none']:.2f} | "
            f"{r['equal_tokens']:.4f} | {r['equal_prefix']:.4f} | {r['mean_acceptance_length']:.2f} | "
            f"{r['drafter_share_of_time']:.2f} | {r['tokens_per_step']:.2f} | "
            f"{r['draft_step_share']:.2f} | {r['decode_step_ms']:.2f} | "
            f"{r['decode_x_none']:.2f} | {r['ideal']:.2f} | {r['of_ideal']:.2f} |"
        )
    for r in rows:
        if r["drafter"] in ("ngram", "eagle") and r["batch"] == 1:
            print(r["drafter"], end=" ")
            print(
                "per kind (× none, batch 1):",
                json.dumps({k: round(v, 2) for k, v in r["per_kind_x_none"].items()}),
            )
            print("acceptance per position:", [round(x, 3) for x in r["acceptance_per_position"]])
    print("floors:", json.dumps({k: round(v, 4) for k, v in results.get("floors", {}).items()}))
    print(
        "HF:",
        json.dumps(
            {
                k: round(v, 3) if isinstance(v, float) else v
                for k, v in results.get("hf", {}).items()
            }
        ),
        results.get("hf_error", ""),
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
