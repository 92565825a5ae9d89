"""``specd-worker`` (``python -m worker.daemon``): check the flags, the model path and the listen
address, then hand over to ``worker.service`` to load, handshake and execute steps.

Everything here runs before torch and transformers are imported (~7 s on a 2-core machine), so
a bad flag (exit 2), an address that cannot be bound (exit 2; checked first, as the address is
bound before the model loads) or a model path that does not exist (exit 3) is refused at once,
naming what was wrong. The socket is bound before the model loads,
as before: a scheduler that connects early waits for the handshake, it is not refused.
"""

from __future__ import annotations

import logging
import sys

import zmq

from protocol.options import setup_logging
from protocol.transport import bind_router
from worker.config import check_model_spec, parse_args

log = logging.getLogger("specd.worker")

EXIT_OK, EXIT_FATAL, EXIT_CONFIG, EXIT_LOAD = 0, 1, 2, 3
GOODBYE_LINGER_MS = 2_000  # the longest a stopping worker waits for its last message to leave


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        print(f"specd-worker: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg.log_level, cfg.log_format)
    if cfg.tp_rank > 0:
        from worker.service import follower_main

        return follower_main(cfg)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        chan = bind_router(ctx, cfg.listen, cfg.transport())
    except zmq.ZMQError as e:
        log.error("cannot bind %s: %s", cfg.listen, e)
        ctx.term()  # bind_router closed what it opened
        return EXIT_CONFIG
    try:
        check_model_spec(cfg.model)
        if cfg.draft_model is not None:
            check_model_spec(cfg.draft_model)
    except OSError as e:  # missing, or a path this user may not read
        log.error("model load failed: %s", e)
        chan.close(linger_ms=0)
        ctx.term()
        return EXIT_LOAD
    from worker.service import serve  # torch and transformers: seconds

    return serve(cfg, argv, ctx, chan)


if __name__ == "__main__":
    sys.exit(main())
