"""``specd``: the harness CLI.

specd run --prompt "Hello" [--worker ipc://...] [--model ...] [--drafter ngram] ...
specd run --file requests.jsonl          # one JSON object per line: Engine.add_request kwargs
specd demo                               # `make run`: four requests on the embedded model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from protocol.transport import TransportConfig, keygen
from scheduler_client.bench_serve import main_bench_serve
from scheduler_client.engine import Engine
from scheduler_client.engine_args import add_engine_args, engine_config, glue_worker_args
from scheduler_client.request import Request
from scheduler_client.worker_client import HandshakeError, WorkerClient, WorkerDied

DEMO_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
}
DEMO_CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n"
)
DEMO = [
    {
        "req_id": "json-extract",
        "max_tokens": 60,
        "structured": {"json": DEMO_SCHEMA},
        "messages": [
            {
                "role": "user",
                "content": "Extract the person as JSON: Maria Lopez is 34 "
                "years old and lives in Lisbon.",
            }
        ],
    },
    {
        "req_id": "regex-date",
        "max_tokens": 20,
        "structured": {"regex": r"\d{4}-\d{2}-\d{2}"},
        "messages": [{"role": "user", "content": "When did the Berlin Wall fall? Give the date."}],
    },
    {
        "req_id": "choice",
        "max_tokens": 8,
        "structured": {"choice": ["positive", "negative"]},
        "messages": [{"role": "user", "content": "Sentiment of 'I love this phone!'?"}],
    },
    {
        "req_id": "edit-ngram",
        "max_tokens": 80,
        "messages": [
            {
                "role": "user",
                "content": "Rename the function mean to average and return "
                "the whole code:\n" + DEMO_CODE,
            }
        ],
    },
]


def _print_result(req: Request) -> None:
    print(
        json.dumps(
            {
                "req_id": req.req_id,
                "text": req.text,
                "finish_reason": req.finish_reason,
                "error": req.error,
                "metrics": req.metrics.summary(),
            },
            ensure_ascii=False,
        )
    )


def _run(engine: Engine, requests: list[dict[str, Any]]) -> int:
    t0 = time.monotonic()
    done = engine.generate(requests)
    for req in done:
        _print_result(req)
    summary = engine.metrics()
    summary["wall_s"] = round(time.monotonic() - t0, 2)
    print(json.dumps({"metrics": summary}))
    return 1 if any(r.error for r in done) else 0


def _health(a: argparse.Namespace) -> int:
    transport = TransportConfig(
        curve_secret_file=a.curve_secret, curve_server_public_file=a.curve_server_public
    )
    client = WorkerClient(a.addr, transport=transport)
    t0 = time.monotonic()
    try:
        pong = client.ping(timeout_s=a.timeout)
    except WorkerDied as e:
        print(json.dumps({"ok": False, "addr": a.addr, "error": str(e)}))
        return 1
    finally:
        client.close()
    print(
        json.dumps(
            {
                "ok": True,
                "addr": a.addr,
                "num_steps": pong.num_steps,
                "rtt_ms": round((time.monotonic() - t0) * 1e3, 2),
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="specd",
        description="specd harness: run requests through a scheduler and a worker (two processes)",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one prompt or a JSONL file of requests")
    add_engine_args(run)
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text")
    src.add_argument("--chat", help="one user message, wrapped in the chat template")
    src.add_argument("--file", help="JSONL: one object of Engine.add_request arguments per line")
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--json-schema", help="file with a JSON schema the output must match")
    run.add_argument("--regex", help="regex the output must match")
    run.add_argument("--choice", nargs="+", help="the output must be one of these")
    kg = sub.add_parser(
        "keygen",
        help="write a CURVE certificate pair DIR/NAME.key and "
        "DIR/NAME.key_secret (for tcp:// between scheduler and worker)",
    )
    kg.add_argument("directory")
    kg.add_argument("name")
    bs = sub.add_parser(
        "bench-serve",
        help="replay a JSONL workload at a request rate; report latency percentiles, throughput "
        "and acceptance",
    )
    add_engine_args(bs)
    bs.add_argument("--file", required=True, help="JSONL of Engine.add_request arguments")
    bs.add_argument(
        "--rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    bs.add_argument(
        "--num-requests", type=int, default=None, help="cycle the file to this many requests"
    )
    health = sub.add_parser(
        "health", help="ping a worker through its step loop; exit 0 if it answers, 1 if not"
    )
    health.add_argument("addr")
    health.add_argument("--timeout", type=float, default=5.0)
    health.add_argument("--curve-secret", default=None)
    health.add_argument("--curve-server-public", default=None)
    demo = sub.add_parser("demo", help="the `make run` demo on the embedded model")
    add_engine_args(demo)
    a = ap.parse_args(glue_worker_args(argv))

    if a.cmd == "health":
        return _health(a)
    if a.cmd == "keygen":
        public, secret = keygen(a.directory, a.name)
        print(f"public: {public}\nsecret: {secret} (keep it private; mode 600)")
        return 0
    if a.cmd == "bench-serve":
        try:
            with Engine(engine_config(a)) as engine:
                return main_bench_serve(engine, a.file, a.rate, a.num_requests)
        except (WorkerDied, HandshakeError, FileNotFoundError, ValueError) as e:
            print(f"specd: {e}", file=sys.stderr)
            return 2
    if a.cmd == "demo":
        requests = DEMO
        if a.device is None:
            a.device = "cpu"
    elif a.file:
        with open(a.file) as f:
            requests = [json.loads(line) for line in f if line.strip()]
    else:
        structured: dict[str, Any] | None = None
        if a.json_schema:
            with open(a.json_schema) as f:
                structured = {"json": json.load(f)}
        elif a.regex:
            structured = {"regex": a.regex}
        elif a.choice:
            structured = {"choice": a.choice}
        req: dict[str, Any] = {
            "max_tokens": a.max_tokens,
            "temperature": a.temperature,
            "structured": structured,
        }
        if a.prompt is not None:
            req["prompt"] = a.prompt
        else:
            req["messages"] = [{"role": "user", "content": a.chat}]
        requests = [req]
    try:
        with Engine(engine_config(a)) as engine:
            print(
                f"# worker ready: {engine.ready.model_name}, drafter {engine.ready.drafter}, "
                f"k={engine.ready.max_num_speculative_tokens}",
                file=sys.stderr,
            )
            return _run(engine, requests)
    except (WorkerDied, HandshakeError, FileNotFoundError, ValueError) as e:
        print(f"specd: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
