"""The flags that build an ``EngineConfig``, shared by ``specd run``/``demo``/``bench-serve`` and the
``specd-scheduler`` daemon."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from protocol.transport import TransportConfig
from scheduler_client.engine import EngineConfig
from scheduler_client.scheduler import SchedulerConfig


def _steps_in_flight(value: str) -> int | str:
    """--max-steps-in-flight: a count, or ``auto``."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a count (2..4) or auto, got {value!r}"
        ) from None


def glue_worker_args(argv: Sequence[str] | None) -> list[str]:
    """``argv`` (None: the command line's) with ``--worker-args VALUE`` as
    ``--worker-args=VALUE``: argparse takes a lone flag given as the value
    (``--worker-args --pipeline-steps``) for an option of its own and says the value is missing."""
    args = list(sys.argv[1:] if argv is None else argv)
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--worker-args" and i + 1 < len(args):
            out.append(f"--worker-args={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--curve-secret",
        default=None,
        help="this scheduler's CURVE certificate (.key_secret) for a tcp:// worker",
    )
    ap.add_argument(
        "--curve-server-public", default=None, help="the worker's public CURVE certificate (.key)"
    )
    ap.add_argument(
        "--worker",
        default=None,
        help="connect to a running worker at this address instead of launching one",
    )
    ap.add_argument("--model", default="embedded:smollm2", help="model for the launched worker")
    ap.add_argument(
        "--drafter", default="ngram", choices=("none", "ngram", "draft_model", "parallel", "eagle")
    )
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--eagle-head", default=None, help="EAGLE head folder (with --drafter eagle)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: CUDA when present)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the most requests running at once (default: the worker's, from its handshake); "
        "passed on to a launched worker (its KV slots); above a running worker's "
        "--max-num-seqs the scheduler refuses to start",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the most tokens one step schedules, prefill chunks and drafts included (default: "
        "the worker's, from its handshake); passed on to a launched worker; above a running "
        "worker's value the scheduler refuses to start",
    )
    ap.add_argument(
        "--kv-watermark",
        type=float,
        default=0.04,
        help="the share of the worker's KV blocks a new request may not take when admitted "
        "(vLLM's watermark): room for the running requests to grow before one is preempted "
        "and recomputed",
    )
    ap.add_argument("--grammar-backend", default="llguidance")
    ap.add_argument(
        "--no-forced-drafts",
        action="store_true",
        help="do not offer grammar-forced tokens as drafts",
    )
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap scheduling: send the next step before this one's output arrives "
        "(structured greedy requests get their grammar rows in a deferred message); default: "
        "on for a worker that leaves steps open (--pipeline-steps, its default on CUDA), off "
        "for others (a CPU worker)",
    )
    ap.add_argument(
        "--max-steps-in-flight",
        type=_steps_in_flight,
        default=None,
        help="with --async-scheduling: the most steps sent before the oldest one's output "
        "arrives (2: the next step; 3 gives a worker with --pipeline-steps the step after that "
        "while the scheduler commits; 2..4; default: 3 for a worker that leaves steps open, "
        "else 2); auto: 3, and 2 while the worker drafts and the "
        "scheduler's turnaround "
        "takes under half the time between outputs (long steps, as a draft model's: a new "
        "request then waits one step less for its first token)",
    )
    ap.add_argument(
        "--no-adaptive-speculation",
        action="store_true",
        help="always verify every draft (default: choose the width from measured goodput)",
    )
    ap.add_argument(
        "--no-speculation-guard",
        action="store_true",
        help="with adaptive speculation: do not judge the tuner by its outcome (default: per "
        "batch size, windows of 32 steps with drafting off are compared with the tuner's by "
        "their output tokens a second, each probe against the windows either side of it; two "
        "probes that win by 3%% turn the preference over; probes come after 2 windows, then "
        "twice as far each time they lose "
        "by 3%%, up to 64, and after 8 where the two are within 3%% or after a switch)",
    )
    ap.add_argument("--worker-log", default=None, help="file for the launched worker's log")
    ap.add_argument(
        "--worker-args",
        default="",
        help="more specd-worker flags for the launched worker, one string (split as a shell "
        'would: --worker-args "--dtype float16 --no-pipeline-steps")',
    )
    ap.add_argument(
        "--step-trace",
        default=None,
        help="append one JSON line per step output to this file: its requests, draft cap and "
        "the widest drafts it ran, the drafts asked for after it, prefill tokens, the worker's "
        "time for it (ms), drafts run and accepted (what the speculation tuner saw)",
    )
    ap.add_argument(
        "--max-worker-restarts",
        type=int,
        default=3,
        help="after a worker dies: relaunch it (or wait for a new one at --worker) and replay "
        "in-flight requests, at most this many times within --restart-window-s (0: fail them "
        "instead); a request running at two deaths is failed, not replayed again",
    )
    ap.add_argument(
        "--restart-window-s",
        type=float,
        default=600.0,
        help="the window of --max-worker-restarts: restarts older than this many seconds are "
        "not counted",
    )
    ap.add_argument(
        "--stall-threshold-s",
        type=float,
        default=60.0,
        help="/health answers 503 'stalled' while a step has been outstanding this long",
    )
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve the scheduler's Prometheus metrics on this port (0: off; -1: any free port)",
    )


def engine_config(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        worker_addr=a.worker,
        model=a.model,
        drafter=a.drafter,
        draft_model=a.draft_model,
        eagle_head=a.eagle_head,
        num_speculative_tokens=a.num_speculative_tokens,
        device=a.device,
        max_model_len=a.max_model_len,
        worker_max_num_seqs=a.max_num_seqs,
        worker_max_num_batched_tokens=a.max_num_batched_tokens,
        grammar_backend=a.grammar_backend,
        worker_log=a.worker_log,
        worker_args=tuple(shlex.split(a.worker_args)),
        step_trace=a.step_trace,
        max_worker_restarts=a.max_worker_restarts,
        restart_window_s=a.restart_window_s,
        stall_threshold_s=a.stall_threshold_s,
        metrics_port=a.metrics_port,
        transport=TransportConfig(
            curve_secret_file=a.curve_secret, curve_server_public_file=a.curve_server_public
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            forced_drafts=not a.no_forced_drafts,
            async_scheduling=a.async_scheduling,
            max_steps_in_flight=3 if a.max_steps_in_flight == "auto" else a.max_steps_in_flight,
            steps_in_flight_auto=a.max_steps_in_flight == "auto",
            adaptive_speculation=not a.no_adaptive_speculation,
            speculation_guard=not a.no_speculation_guard,
            kv_watermark=a.kv_watermark,
        ),
    )
