"""An echo peer for tests and benchmarks: ``python -m protocol.echo ADDR [--count-only]``.

Connects a DEALER to ``ADDR`` and sends back every message it decodes (or, with ``--count-only``,
a ``Pong`` whose ``num_steps`` is the number of messages decoded, after each ``Ping``). Stops on
``Shutdown`` or after 60 s of silence.
"""

from __future__ import annotations

import sys

import zmq

from protocol.messages import Ping, Pong, Shutdown
from protocol.transport import TransportConfig, connect_dealer


def main(argv: list[str]) -> int:
    addr = argv[0]
    count_only = "--count-only" in argv
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    chan = connect_dealer(ctx, addr, TransportConfig())
    decoded = 0
    try:
        chan.send(Ping(seq=-1))  # announce ourselves so the ROUTER learns our identity
        while True:
            got = chan.recv(timeout_ms=60_000)
            if got is None:
                return 1
            _, msg = got
            decoded += 1
            if isinstance(msg, Shutdown):
                return 0
            if not count_only:
                chan.send(msg)
            elif isinstance(msg, Ping):
                chan.send(Pong(seq=msg.seq, num_steps=decoded))
    finally:
        chan.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
