"""Distil an EAGLE-style head (``worker/eagle_head.py``) for a target from its own generations.

    python bench/train_eagle.py --model SmolLM2.gguf --device cuda --out heads/smollm2-eagle \
        --minutes 8

Data recipe: the prompt set below (code edits, JSON extraction, questions, stories; each wrapped
in the target's chat template) is decoded greedily by the target itself (``--gen-tokens`` each);
the target's final hidden states over prompt + generation are the features. Loss per position t:
smooth-L1 between the head's prediction and f_{t+1}, plus cross-entropy of the target's LM head on
that prediction against x_{t+2} (EAGLE's two terms). Adam, cosine decay, stopped at ``--minutes``.
Writes the head (bf16 safetensors + config), ``train_log.json`` and ``loss.png`` (with matplotlib),
then measures acceptance on held-out prompts through the worker's runner, n-gram alongside.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.prompts import CODE
from worker.eagle_head import EagleHead, head_config
from worker.model_loader import resolve_model_dir

TOPICS = [
    "a lighthouse",
    "a robot",
    "the ocean",
    "a city at night",
    "a chess game",
    "autumn",
    "a small bakery",
    "the moon",
    "a train journey",
    "a lost key",
]
PEOPLE = [
    "Ana Silva, 29, a nurse in Porto",
    "Kenji Mori, 41, a chef in Kyoto",
    "Lena Vogel, 35, an architect in Vienna",
    "Omar Haddad, 52, a pilot in Amman",
]
TRAIN = (
    [f"Write a short story about {t}." for t in TOPICS]
    + [f"Explain {t} to a child in three sentences." for t in TOPICS]
    + [f"Extract name, age, job and city as JSON: {p}." for p in PEOPLE]
    + [
        f"Rename load_config to {n} and return the whole code:\n{CODE}"
        for n in ("read_config", "get_config", "parse_config")
    ]
    + [
        "List five fruits as a JSON array.",
        "What is the capital of Italy? Answer briefly.",
        "Give three tips for learning Python.",
        "Summarise the water cycle.",
    ]
)
HELD_OUT = [
    "Write a short story about a dragon who bakes bread.",
    "Extract name, age, job and city as JSON: Mia Berg, 23, a teacher in Oslo.",
    f"Rename load_config to load_settings and return the whole code:\n{CODE}",
]


def chat(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    s = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return list(tok(s, add_special_tokens=False).input_ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded:smollm2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--num-prompts", type=int, default=len(TRAIN))
    ap.add_argument("--eval-tokens", type=int, default=128)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_start = time.monotonic()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, directory = resolve_model_dir(a.model)
    tok = AutoTokenizer.from_pretrained(directory)
    target = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="sdpa"
    )
    target.to(device).eval().requires_grad_(False)
    # 1. the target's own greedy text
    seqs = []
    for text in TRAIN[: a.num_prompts]:
        ids = torch.tensor([chat(tok, text)], device=device)
        out = target.generate(ids, max_new_tokens=a.gen_tokens, do_sample=False, pad_token_id=0)
        seqs.append(out[0])
    gen_s = time.monotonic() - t_start
    # 2. features
    data = []
    with torch.no_grad():
        for s in seqs:
            h = target(s[None], output_hidden_states=True).hidden_states[-1]  # [1, T, H]
            data.append((s, h))
    # 3. train
    head = EagleHead(head_config(target.config), "sdpa").to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=a.lr, weight_decay=0.0)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    budget = a.minutes * 60 - (time.monotonic() - t_start)
    log, step, t0 = [], 0, time.monotonic()
    while step < a.max_steps and time.monotonic() - t0 < budget:
        ids, feats = data[step % len(data)]
        frac = min((time.monotonic() - t0) / max(budget, 1e-9), 1.0)
        for g in opt.param_groups:
            g["lr"] = a.lr * 0.5 * (1 + math.cos(math.pi * frac))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = head(
                embed(ids[None, 1:]),
                feats[:, :-1].float().to(embed.weight.dtype),
                torch.arange(len(ids) - 1, device=device)[None],
            )
            logits = lm_head(pred.to(lm_head.weight.dtype)).float()
        reg = F.smooth_l1_loss(pred.float()[:, :-1], feats.float()[:, 1:-1])
        ce = F.cross_entropy(logits[0, :-1], ids[2:])
        loss = reg + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(
            {
                "step": step,
                "loss": loss.item(),
                "reg": reg.item(),
                "ce": ce.item(),
                "s": round(time.monotonic() - t_start, 2),
            }
        )
        step += 1
    head = head.to(torch.bfloat16)
    head.save(a.out)
    size = os.path.getsize(os.path.join(a.out, "model.safetensors"))
    summary = {
        "steps": step,
        "generation_s": round(gen_s, 1),
        "total_s": round(time.monotonic() - t_start, 1),
        "weights_bytes": size,
        "final_loss": log[-1] if log else None,
        "num_sequences": len(seqs),
        "num_tokens": int(sum(len(s) for s in seqs)),
    }
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump({"summary": summary, "log": log}, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        ax.plot([x["step"] for x in log], [x["loss"] for x in log], linewidth=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (smooth-L1 + 0.1 CE)")
        ax.set_yscale("log")
        ax.set_title("EAGLE head distillation")
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "loss.png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no loss.png", file=sys.stderr)
    summary["eval"] = evaluate(a, tok, directory)
    with open(os.path.join(a.out, "train_log.json"), "w") as f:
        json.dump({"summary": summary, "log": log}, f)
    print(json.dumps(summary))


def evaluate(a: argparse.Namespace, tok, directory: str) -> dict[str, float]:
    """Mean acceptance length and tokens/s of the trained head vs n-gram vs none on HELD_OUT,
    through the worker's runner (greedy; every output equal to the no-draft one is checked)."""
    from tests.driver import Req, run
    from worker.attention import ATTN_IMPLEMENTATION
    from worker.drafters.base import Drafter, NoDrafter
    from worker.drafters.eagle import EagleDrafter
    from worker.drafters.ngram import NgramDrafter
    from worker.model_executor import ModelExecutor
    from worker.model_loader import load_model
    from worker.runner import ModelRunner

    device = torch.device(a.device)
    target = load_model(directory, device=device).model
    head = EagleHead.load(
        a.out,
        attn_implementation=ATTN_IMPLEMENTATION,
        dtype=next(target.parameters()).dtype,
        device=device,
    )
    prompts = [chat(tok, t) for t in HELD_OUT]
    vocab = target.config.get_text_config().vocab_size
    drafters: dict[str, Drafter] = {
        "none": NoDrafter(),
        "ngram": NgramDrafter(min_n=1, max_n=4, max_num_tokens=4),
        "eagle": EagleDrafter(
            head, target, vocab_size=vocab, max_num_seqs=1, max_model_len=1024, max_num_tokens=4
        ),
    }
    res: dict[str, float] = {}
    outs: dict[str, list[list[int]]] = {}
    for name, drafter in drafters.items():
        k = 0 if name == "none" else 4
        runner = ModelRunner(
            ModelExecutor(target, max_num_seqs=1, max_model_len=1024, decode_width=1 + k),
            drafter,
            max_num_seqs=1,
            max_model_len=1024,
            max_num_draft_tokens=max(k, 1),
        )
        run(runner, [Req("warm", prompts[0], 8, k=k)], 10_000)
        t0 = time.perf_counter()
        reqs = [Req(f"r{i}", p, a.eval_tokens, k=k) for i, p in enumerate(prompts)]
        got = [run(runner, [r], 10_000)[r.req_id] for r in reqs]
        dt = time.perf_counter() - t0
        outs[name] = got
        res[f"{name}_tps"] = round(sum(len(g) for g in got) / dt, 2)
        steps = sum(r.spec_steps for r in reqs)
        res[f"{name}_mean_acceptance_length"] = round(
            1 + sum(r.accepted for r in reqs) / max(steps, 1), 3
        )
    res["eagle_equal_to_none"] = float(outs["eagle"] == outs["none"])
    return res


if __name__ == "__main__":
    main()
