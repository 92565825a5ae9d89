"""(c) A large random-weight Llama-shaped target with an oracle drafter of set acceptance rate.

    python bench/synthetic_bench.py --sizes 1b 8b --alphas 0.5 0.7 0.9 --batches 1 64

The oracle knows the target's greedy continuation (from a run without drafts) and proposes k tokens;
each is the true next token with probability alpha, else a wrong one. For each size, batch and
alpha it reports tokens/s with and without speculation, the measured acceptance rate a (accepted /
drafted), and the ideal speedup that a allows, (1 - a^(k+1)) / ((1 - a)(1 + k c)), with c the
oracle's measured cost per draft relative to a target step (it reads a list: ~0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client.spec_tuner import SpeculationTuner
from tests.driver import Req, run
from worker.drafters.base import Drafter, NoDrafter, Proposal
from worker.dummy_weights import random_model
from worker.model_executor import ModelExecutor
from worker.requests import RequestStates
from worker.runner import ModelRunner

# The 1B and 8B Llama shapes (Llama 3's layers, a 32000-token vocabulary) live in
# bench/configs/llama-SIZE/config.json, where `specd-worker --load-format dummy` reads them too.
CONFIGS = Path(__file__).resolve().parent / "configs"
SIZES = {  # the smaller Llama shapes
    "smollm2": dict(  # SmolLM2-135M's shape (bench/step_profile.py)
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    "smollm2-narrow": dict(  # its 30 layers at a width where host time shows (step_profile.py)
        hidden_size=72,
        intermediate_size=96,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


class OracleDrafter(Drafter):
    """Proposes the known continuation, each token right with probability ``alpha``."""

    name = "oracle"

    def __init__(
        self,
        truth: dict[str, tuple[int, list[int]]],
        alpha: float,
        k: int,
        vocab: int,
        seed: int = 0,
    ) -> None:
        self.truth, self.alpha, self.k, self.vocab = truth, alpha, k, vocab
        self.rng = np.random.default_rng(seed)
        self.seconds = 0.0
        self.num_calls = 0

    def propose(self, states: RequestStates, slots: list[int], widths: list[int]) -> Proposal:
        t0 = time.perf_counter()
        req_of = {s: r for r, s in states.slot_of.items()}
        out = np.zeros((len(slots), max(self.k, 1)), np.int64)
        nums = []
        for j, (slot, w) in enumerate(zip(slots, widths, strict=True)):
            prompt_len, cont = self.truth[req_of[slot]]
            done = int(states.num_tokens[slot]) - prompt_len
            want = cont[done : done + min(w, self.k)]
            right = self.rng.random(len(want)) < self.alpha
            out[j, : len(want)] = np.where(right, want, (np.asarray(want) + 1) % self.vocab)
            nums.append(len(want))
        ids = torch.from_numpy(out).to(states.device)
        self.seconds += time.perf_counter() - t0
        self.num_calls += 1
        return Proposal(ids, nums)


def size_names() -> list[str]:
    return sorted(
        [*SIZES, *(p.parent.name.removeprefix("llama-") for p in CONFIGS.glob("*/config.json"))]
    )


def size_config(size: str) -> PretrainedConfig:
    """The config of ``size``: bench/configs/llama-SIZE, else a Llama of ``SIZES[size]``."""
    if (CONFIGS / f"llama-{size}" / "config.json").is_file():
        return AutoConfig.from_pretrained(CONFIGS / f"llama-{size}")
    return LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **SIZES[size])


def random_target(size: str, device: torch.device) -> torch.nn.Module:
    """A Llama of ``size`` with seeded random weights (bf16 on CUDA, float32 on the CPU), without
    gradients, its greedy choice made stable: the worker's ``--load-format dummy`` model."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return random_model(size_config(size), device=device, dtype=dtype)


def timed_run(model, drafter, prompts, max_tokens, k, batch, mode, truth=None, tuner=None):
    runner = ModelRunner(
        ModelExecutor(
            model, max_num_seqs=batch, max_model_len=1024, batch_invariant=mode, decode_width=1 + k
        ),
        drafter,
        max_num_seqs=batch,
        max_model_len=1024,
        max_num_draft_tokens=max(k, 1),
    )
    reqs = [Req(f"r{j}", p, max_tokens, k=k) for j, p in enumerate(prompts)]
    if truth is not None:
        truth.update({f"w{j}": truth[f"r{j}"] for j in range(len(prompts))})
    # warm-up: the same shapes once (graph capture, allocator), then the measured run
    runner.target.decode.capture_all(len(prompts[0]) + max_tokens + k + 1)
    # the warm-up is the same run untimed, so every shape it meets is captured before timing
    run(runner, [Req(f"w{j}", p, max_tokens, k=k) for j, p in enumerate(prompts)], 10_000, tuner)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    steps0 = runner.num_steps
    t0 = time.perf_counter()
    got = run(runner, reqs, max_steps=100_000, tuner=tuner)
    sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(v) for v in got.values())
    # alpha, the per-draft acceptance probability: draft i is judged only when drafts 0..i-1
    # were accepted, so trials = drafts at position 0 + acceptances at positions 0..k-2
    width = max((len(r.drafted_at) for r in reqs), default=0)
    acc_at = [sum(r.accepted_at[i] for r in reqs if i < len(r.accepted_at)) for i in range(width)]
    trials = sum(r.drafted_at[0] for r in reqs if r.drafted_at) + sum(acc_at[:-1])
    alpha = sum(acc_at) / max(trials, 1)
    return got, tokens / dt, alpha, dt / max(runner.num_steps - steps0, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["1b", "8b"])
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.5, 0.7, 0.9])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    # pad: every width meets the same kernels, so drafts do not change the bf16 arithmetic and
    # the oracle's "true" continuation stays the one the speculative run produces
    ap.add_argument("--batch-invariant", default="pad")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    rows = []
    for size in a.sizes:
        model = random_target(size, device)
        n_params = sum(p.numel() for p in model.parameters())
        rng = np.random.default_rng(1)
        for batch in a.batches:
            prompts = [rng.integers(0, 32000, a.prompt_len).tolist() for _ in range(batch)]
            base, base_tps, _, base_step = timed_run(
                model, NoDrafter(), prompts, a.max_tokens, 0, batch, a.batch_invariant
            )
            for alpha in a.alphas:
                truth = {f"r{j}": (len(p), base[f"r{j}"]) for j, p in enumerate(prompts)}
                oracle = OracleDrafter(truth, alpha, a.k, 32000)
                got, tps, acc, step = timed_run(
                    model, oracle, prompts, a.max_tokens, a.k, batch, a.batch_invariant, truth
                )
                c = (oracle.seconds / max(oracle.num_calls, 1)) / a.k / base_step
                ideal = (1 - acc ** (a.k + 1)) / ((1 - acc) * (1 + a.k * c)) if acc < 1 else a.k + 1
                equal = np.mean([got[r] == base[r] for r in base])
                oracle_a = OracleDrafter(truth, alpha, a.k, 32000, seed=1)
                _, tps_a, _, _ = timed_run(
                    model,
                    oracle_a,
                    prompts,
                    a.max_tokens,
                    a.k,
                    batch,
                    a.batch_invariant,
                    truth,
                    SpeculationTuner(a.k),
                )
                rows.append(
                    dict(
                        size=size,
                        params_b=round(n_params / 1e9, 2),
                        batch=batch,
                        alpha=alpha,
                        tps_none=round(base_tps, 1),
                        tps_spec=round(tps, 1),
                        speedup=round(tps / base_tps, 3),
                        speedup_adaptive=round(tps_a / base_tps, 3),
                        acceptance=round(acc, 3),
                        c=round(c, 4),
                        ideal=round(ideal, 3),
                        of_ideal=round(tps / base_tps / ideal, 3),
                        step_ms_none=round(base_step * 1e3, 2),
                        step_ms_spec=round(step * 1e3, 2),
                        equal_outputs=float(equal),
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        "| size | batch | α set | α measured | tok/s none | tok/s spec | speedup | ideal | of ideal "
        "| adaptive speedup |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['size']} ({r['params_b']}B) | {r['batch']} | {r['alpha']} | {r['acceptance']} | "
            f"{r['tps_none']} | {r['tps_spec']} | {r['speedup']} | {r['ideal']} | {r['of_ideal']} "
            f"| {r['speedup_adaptive']} |"
        )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
