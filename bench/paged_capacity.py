"""How many requests the paged KV cache serves at once, against the slot cache it replaced.

    python bench/paged_capacity.py --max-model-len 8192 --slots 4 --requests 96 \
        --kv-watermarks 0 0.01 0.02 0.04 0.08 --json-out cap.json

The slot cache held one slot of ``max_model_len`` tokens per request: the memory of ``--slots``
slots served ``--slots`` requests, whatever their real lengths. Here the worker gets exactly that
memory as paged blocks (``--num-kv-blocks`` = slots x max_model_len / block size) and
``--max-num-seqs`` far above it, and the scheduler admits by free blocks (preempting, and later
recomputing, when they run out). The workload's requests average about 1k tokens (prompt of
``--prompt-tokens`` +- a quarter, ``--output-tokens`` out, EOS ignored), all queued at once.
Reported, a row per ``--kv-watermarks`` value (the share of blocks a new request may not take):
running requests per step (mean over the steps while requests still wait, and peak), preemptions,
and that every request got all its tokens. A launched worker and the scheduler are
real processes; the model is a small random-weight Llama on the CPU (the block accounting does not
depend on the device or the model's width).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client.engine import Engine, EngineConfig
from scheduler_client.scheduler import SchedulerConfig

CONFIG = os.path.join(os.path.dirname(__file__), "configs", "llama-1b", "config.json")


def tiny_model(directory: str) -> str:
    """A 2-layer Llama of the 1B config's vocabulary, with room for ``max_model_len``."""
    with open(CONFIG) as f:
        cfg = json.load(f)
    cfg.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
    )
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--slots", type=int, default=4, help="the slot cache's requests = its memory")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=768)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kv-watermarks",
        type=float,
        nargs="+",
        default=[SchedulerConfig.kv_watermark],
        help="a row each: the share of blocks a new request may not take (0: to the last block)",
    )
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    blocks = a.slots * a.max_model_len // a.block_size
    print(
        f"seed {a.seed}; {blocks} blocks of {a.block_size} = {a.slots} slots of {a.max_model_len}"
    )
    rows = [run(a, blocks, w) for w in a.kv_watermarks]
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


def run(a: argparse.Namespace, blocks: int, watermark: float) -> dict[str, object]:
    """One row: the workload (the same for every watermark: one seed) through a fresh worker."""
    rng = random.Random(a.seed)
    worker_args = ("--load-format", "dummy", "--num-kv-blocks", str(blocks))
    worker_args += ("--kv-block-size", str(a.block_size))
    with tempfile.TemporaryDirectory(prefix="specd-cap-") as tmp:
        cfg = EngineConfig(
            model=tiny_model(tmp),
            drafter="none",
            num_speculative_tokens=0,
            device="cpu",
            max_model_len=a.max_model_len,
            worker_max_num_seqs=a.max_num_seqs,
            worker_args=worker_args,
            scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, kv_watermark=watermark),
            worker_log=os.devnull,
        )
        with Engine(cfg) as engine:
            q = a.prompt_tokens // 4
            lengths = [a.prompt_tokens + rng.randint(-q, q) for _ in range(a.requests)]
            reqs = [
                engine.add_request(
                    [rng.randrange(3, 32000) for _ in range(n)],
                    max_tokens=a.output_tokens,
                    ignore_eos=True,
                )
                for n in lengths
            ]
            sch = engine.scheduler
            running: list[int] = []  # per step while requests wait
            peak = 0
            t0 = time.perf_counter()
            while sch.has_work():
                engine.step()
                peak = max(peak, len(sch.running))
                if sch.waiting:
                    running.append(len(sch.running))
            wall = time.perf_counter() - t0
            complete = sum(len(r.output_ids) == a.output_tokens and not r.error for r in reqs)
            preemptions = sch.num_preemptions
    mean = sum(running) / max(len(running), 1)
    row = {
        "kv_watermark": watermark,
        "max_model_len": a.max_model_len,
        "kv_blocks": blocks,
        "block_size": a.block_size,
        "slot_cache_requests": a.slots,
        "mean_request_tokens": round(sum(lengths) / len(lengths) + a.output_tokens, 1),
        "requests": a.requests,
        "complete": complete,
        "mean_running_while_queued": round(mean, 2),
        "peak_running": peak,
        "preemptions": preemptions,
        "over_slot_cache": round(mean / a.slots, 2),
        "wall_s": round(wall, 1),
    }
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
