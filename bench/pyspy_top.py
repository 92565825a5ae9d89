"""Counts py-spy raw stacks (``serve_bench --profile-scheduler``) by thread and by frame: the
share of the samples each thread spent running (not waiting in a poll, select, lock or
condition) and the frames that running time went to, inclusive.

    python bench/pyspy_top.py LOG_DIR/pyspy-none-overlap-c64.txt [--top 25]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

# leaf frames that are a thread waiting, not working (py-spy samples idle threads too)
IDLE = ("select", "poll", "wait", "_wait_for_tstate_lock", "acquire", "get", "accept")


def frame_name(frame: str) -> str:
    name, _, where = frame.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    total: Counter[str] = Counter()
    busy: Counter[str] = Counter()
    frames: Counter[tuple[str, str]] = Counter()
    for line in Path(a.raw).read_text().splitlines():
        stack, _, n_s = line.rpartition(" ")
        thread, *stack_frames = stack.split(";")
        thread, n = thread.rsplit(": ", 1)[-1], int(n_s)
        total[thread] += n
        leaf = stack_frames[-1].split(" (")[0].rsplit(".", 1)[-1] if stack_frames else ""
        if leaf in IDLE:
            continue
        busy[thread] += n
        for name in dict.fromkeys(frame_name(f) for f in stack_frames):
            frames[(thread, name)] += n
    print("| thread | samples | running |\n|---|---:|---:|")
    for thread, n in total.most_common():
        print(f"| {thread} | {n} | {busy[thread] / n:.0%} |")
    print("\n| thread | frame (inclusive, running samples) | share of thread's samples |")
    print("|---|---|---:|")
    for (thread, name), n in frames.most_common(a.top):
        print(f"| {thread} | {name} | {n / total[thread]:.0%} |")


if __name__ == "__main__":
    main()
