"""Which preparation work holds the GIL (issue #15 item 2): the numbers behind prep.py's choice of
processes for tokenizing and threads for grammars.

    python bench/gil_bench.py --prompt-mb 10 --alternatives 5000

Each piece of work runs on a thread while a ticker thread sleeps 1 ms at a time; the ticker's
largest gap is how long the work kept every other Python thread (the engine's) from running.
Byte-level tokenizer (worker/byte_tokenizer.py), llguidance as the scheduler configures it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from scheduler_client.grammar import LLGuidanceBackend, StructuredSpec
from scheduler_client.tokenizer import TokenizerInfo
from worker.byte_tokenizer import BYTE_VOCAB, EOS_ID, save_byte_tokenizer


def stall(label: str, work: Callable[[], object]) -> None:
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    seconds = time.perf_counter() - t0
    done.set()
    ticker.join()
    print(f"| {label} | {seconds:.2f} s | {max(gaps) * 1e3:.0f} ms |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-mb", type=float, default=10.0)
    ap.add_argument("--alternatives", type=int, default=5000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tok = TokenizerInfo(str(save_byte_tokenizer(Path(d))))
    backend = LLGuidanceBackend(tok.json_text, BYTE_VOCAB, (EOS_ID,))
    text = "hello world " * int(a.prompt_mb * 1e6 / 12)
    n = a.alternatives
    anyof = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
            for i in range(n)
        ]
    }
    print("| work | time | the other thread's largest stall |\n|---|---|---|")
    stall(f"`encode` {a.prompt_mb:g} MB", lambda: tok.tokenizer.encode(text))
    stall(f"`encode_batch` {a.prompt_mb:g} MB", lambda: tok.tokenizer.encode_batch([text]))
    stall(
        f"JSON schema, enum of {n}: compile + matcher",
        lambda: backend.matcher(StructuredSpec("json", {"enum": [f"v{i}" for i in range(n)]})),
    )
    stall(
        f"JSON schema, anyOf of {n} objects: compile + matcher",
        lambda: backend.matcher(StructuredSpec("json", anyof)),
    )


if __name__ == "__main__":
    main()
