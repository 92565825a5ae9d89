"""Encode + send + receive + decode cost per message between two processes over ipc://.

    python bench/protocol_bench.py [--iters N]

Two figures per row, both from this run on this machine:
  one-way  pipelined: N messages sent back to back, the peer decodes each; total time / N.
  rtt/2    ping-pong: the peer decodes and re-encodes each message; round-trip time / 2 (median).
Messages: SchedulerOutput (a decode step, 4 drafts per request, bitmask rows for half the requests,
vocab 49152) and DraftTokenIds (4 drafts per request).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from protocol import Ping, Pong, Shutdown, TransportConfig, bind_router
from protocol.messages import Message
from tests.wire_samples import draft_ids, sched_output


def measure(addr: str, make: object, batch: int, iters: int) -> tuple[float, float]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    chan = bind_router(ctx, addr, TransportConfig())
    results = []
    try:
        for mode in ("--count-only", ""):
            proc = subprocess.Popen(
                [sys.executable, "-m", "protocol.echo", addr, *([mode] if mode else [])]
            )
            got = chan.recv(timeout_ms=30_000)
            assert got is not None
            peer = got[0]
            msg: Message = make(batch)  # type: ignore[operator]
            if mode:
                for _ in range(20):
                    chan.send(msg, peer)
                chan.send(Ping(seq=0), peer)
                chan.recv(timeout_ms=30_000)
                t0 = time.perf_counter()
                for _ in range(iters):
                    chan.send(msg, peer)
                chan.send(Ping(seq=1), peer)
                reply = chan.recv(timeout_ms=60_000)
                dt = time.perf_counter() - t0
                assert reply is not None and isinstance(reply[1], Pong)
                results.append(dt / iters * 1e6)
            else:
                rtts = []
                for i in range(iters + 20):
                    t0 = time.perf_counter()
                    chan.send(msg, peer)
                    assert chan.recv(timeout_ms=30_000) is not None
                    if i >= 20:
                        rtts.append(time.perf_counter() - t0)
                results.append(statistics.median(rtts) / 2 * 1e6)
            chan.send(Shutdown(), peer)
            proc.wait(timeout=30)
    finally:
        chan.close()
        ctx.term()
    return results[0], results[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    print("| message | batch | bytes | one-way pipelined µs/msg | rtt/2 µs/msg |")
    print("|---|---:|---:|---:|---:|")
    from protocol import Codec

    with tempfile.TemporaryDirectory() as d:
        addr = f"ipc://{d}/bench"
        cases = (
            ("SchedulerOutput", sched_output),
            ("SchedulerOutput, no bitmask", lambda b: sched_output(b, structured_every=0)),
            ("DraftTokenIds", draft_ids),
        )
        for name, make in cases:
            for batch in (1, 64, 256):
                size = sum(len(f) for f in Codec().encode(make(batch)))
                one_way, half_rtt = measure(addr, make, batch, args.iters)
                print(f"| {name} | {batch} | {size} | {one_way:.1f} | {half_rtt:.1f} |", flush=True)


if __name__ == "__main__":
    main()
