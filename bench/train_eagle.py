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
    "a lighthouse", "a robot", "the ocean", "a city at night", "a chess game", "autumn",
    "a small bakery", "the moon", "a train journey", "a lost key", "a volcano", "a library",
    "a desert caravan", "a snowstorm", "a garden", "a space station", "a river", "an old clock",
    "a football match", "a market", "a forest fire", "a paper boat", "a mountain village",
    "a thunderstorm",
]  # fmt: skip
TASKS = [
    "Write a short story about {}.",
    "Explain {} to a child in three sentences.",
    "Write a poem about {}.",
    "Describe {} in five bullet points.",
    "Give three facts about {} as a JSON list of strings.",
]
PEOPLE = [
    "Ana Silva, 29, a nurse in Porto", "Kenji Mori, 41, a chef in Kyoto",
    "Lena Vogel, 35, an architect in Vienna", "Omar Haddad, 52, a pilot in Amman",
    "Sara Costa, 44, a judge in Milan", "Tom Baker, 31, a plumber in Leeds",
    "Priya Nair, 27, a data analyst in Pune", "Jonas Berg, 60, a fisherman in Bergen",
]  # fmt: skip
SNIPPETS = [
    CODE,
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n"
    "    def increment(self):\n        self.count += 1\n        return self.count\n",
]
TRAIN = (
    [t.format(x) for t in TASKS for x in TOPICS]
    + [f"Extract name, age, job and city as JSON: {p}." for p in PEOPLE]
    + [f"Write a JSON object describing {p}, with a list of hobbies." for p in PEOPLE]
    + [
        f"{verb} and return the whole code:\n{code}"
        for code in SNIPPETS
        for verb in (
            "Add type hints",
            "Add a docstring",
            "Rename every variable to a longer name",
            "Convert it to use snake_case everywhere",
        )
    ]
    + [
        "List five fruits as a JSON array.",
        "What is the capital of Italy? Answer briefly.",
        "Give three tips for learning Python.",
        "Summarise the water cycle.",
        "Fix the grammar: me and him goes to the shop yesterday and buyed bread.",
        "Translate to French: The weather is nice today.",
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


def generate(target, tok, prompts: list[list[int]], a, device) -> list[torch.Tensor]:
    """Greedy continuations, ``a.gen_batch`` prompts at a time; each kept up to its first EOS."""
    eos = (
        set(target.generation_config.eos_token_id or [])
        if isinstance(target.generation_config.eos_token_id, list)
        else {target.generation_config.eos_token_id}
    )
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out: list[torch.Tensor] = []
    for i in range(0, len(prompts), a.gen_batch):
        group = prompts[i : i + a.gen_batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        gen = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=a.gen_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        for p, row in zip(group, gen.tolist(), strict=True):
            new = row[width:]
            cut = next((j + 1 for j, t in enumerate(new) if t in eos), len(new))
            out.append(torch.tensor(p + new[:cut], device=device))
    return out


def pad_batch(
    seqs: list[torch.Tensor], feats: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: ids [B, T], features [B, T, H] float32, valid [B, T] float32."""
    n = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), n), dtype=torch.long, device=device)
    f = torch.zeros((len(seqs), n, feats[0].shape[-1]), dtype=torch.float32, device=device)
    valid = torch.zeros((len(seqs), n), dtype=torch.float32, device=device)
    for j, (s, h) in enumerate(zip(seqs, feats, strict=True)):
        ids[j, : len(s)], f[j, : len(s)], valid[j, : len(s)] = s, h.float(), 1.0
    return ids, f, valid


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
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per training step")
    ap.add_argument("--feature-noise", type=float, default=0.1, help="uniform noise width on f_t")
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
    # 1. the target's own greedy text, decoded in batches (left padding)
    seqs = generate(target, tok, [chat(tok, t) for t in TRAIN[: a.num_prompts]], a, device)
    gen_s = time.monotonic() - t_start
    # 2. features: the target's final hidden states, one unpadded forward per sequence
    with torch.no_grad():
        feats = [target(s[None], output_hidden_states=True).hidden_states[-1][0] for s in seqs]
    # 3. train on minibatches of whole sequences, right-padded; padded positions carry no loss
    head = EagleHead(head_config(target.config), "sdpa").to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=a.lr, weight_decay=0.0)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    budget = a.minutes * 60 - (time.monotonic() - t_start)
    gen = torch.Generator().manual_seed(0)
    log, step, t0 = [], 0, time.monotonic()
    while step < a.max_steps and time.monotonic() - t0 < budget:
        pick = torch.randint(len(seqs), (a.batch_size,), generator=gen).tolist()
        ids, f, valid = pad_batch([seqs[i] for i in pick], [feats[i] for i in pick], device)
        frac = min((time.monotonic() - t0) / max(budget, 1e-9), 1.0)
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        noise = (torch.rand_like(f[:, :-1]) - 0.5) * a.feature_noise if a.feature_noise else 0.0
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = head(
                embed(ids[:, 1:]),
                f[:, :-1] + noise,
                torch.arange(ids.shape[1] - 1, device=device)[None].expand(len(pick), -1),
            )  # pred[:, t] ~ f[:, t + 1]
            logits = lm_head(pred[:, :-1].to(lm_head.weight.dtype)).float()  # ~ x[:, t + 2]
        m = valid[:, 2:]  # positions t with both f_{t+1} and x_{t+2} real
        reg = F.smooth_l1_loss(pred.float()[:, :-1], f[:, 1:-1], reduction="none").mean(-1) * m
        reg = reg.sum() / m.sum()
        ce = F.cross_entropy(logits.transpose(1, 2), ids[:, 2:], reduction="none")
        ce = (ce * m).sum() / m.sum()
        loss = reg + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
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
        "num_prompts": len(TRAIN[: a.num_prompts]),
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
    from worker.drafters.base import Drafter, NoDrafter
    from worker.drafters.eagle import EagleDrafter
    from worker.drafters.ngram import NgramDrafter
    from worker.model_executor import ModelExecutor
    from worker.model_loader import load_model
    from worker.runner import ModelRunner

    device = torch.device(a.device)
    target = load_model(directory, device=device).model
    prompts = [chat(tok, t) for t in HELD_OUT]
    drafters: dict[str, Drafter] = {
        "none": NoDrafter(),
        "ngram": NgramDrafter(min_n=1, max_n=4, max_num_tokens=4),
        "eagle": EagleDrafter.from_files(
            a.out, target, max_num_seqs=1, max_model_len=1024, max_num_tokens=4
        ),
    }
    res: dict[str, float] = {}
    outs: dict[str, list[list[int]]] = {}
    for name, drafter in drafters.items():
        k = 0 if name == "none" else 4
        runner = ModelRunner(
            ModelExecutor(
                target,
                max_num_seqs=1,
                max_model_len=1024,
                decode_width=1 + k,
                batch_invariant="pad" if device.type == "cuda" else "off",
            ),
            drafter,
            max_num_seqs=1,
            max_model_len=1024,
            max_num_draft_tokens=max(k, 1),
        )
        runner.target.decode.capture_all(max(map(len, prompts)) + a.eval_tokens + k + 1)
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
