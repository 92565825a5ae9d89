"""``specd-scheduler``: the scheduler as a long-running daemon with an OpenAI-compatible HTTP front
door. It launches a worker (or connects to one with ``--worker``), shakes hands, then listens.

Lifecycle: ready (``/health`` 200, "ready" logged) only after the worker has loaded its models and
the handshake is done. SIGTERM or SIGINT drains: new requests get 503, running ones finish for up to
``--drain-timeout`` seconds and are then aborted, the worker is told to stop, and the process exits 0.

Exit codes: 0 clean shutdown; 1 the worker was lost for good or the loop failed; 2 bad
configuration; 3 no worker (launch, connect or handshake failed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import generate_latest

from protocol.gc_heap import freeze_heap
from protocol.options import add_log_args, parse_with_config, setup_logging
from scheduler_client.engine import Engine, EngineConfig
from scheduler_client.engine_args import add_engine_args, engine_config, glue_worker_args
from scheduler_client.engine_loop import EngineLoop
from scheduler_client.grammar import set_grammar_threads
from scheduler_client.http.api_server import ApiServerProcess
from scheduler_client.http.door import Door
from scheduler_client.http.server import DoorLimits, DoorServer
from scheduler_client.limits import InputLimits, add_limit_args, input_limits
from scheduler_client.prep import Preparer
from scheduler_client.prom import merged_registry
from scheduler_client.worker_client import HandshakeError, WorkerDied

log = logging.getLogger("specd.scheduler")

EXIT_OK, EXIT_FATAL, EXIT_CONFIG, EXIT_WORKER = 0, 1, 2, 3


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the worker's model name
    api_key_file: str | None = None
    drain_timeout_s: float = 30.0
    max_active_requests: int = 4096
    max_request_bytes: int = 16 << 20
    data_parallel_size: int = 1
    limits: DoorLimits = dataclasses.field(default_factory=DoorLimits)
    input_limits: InputLimits = dataclasses.field(default_factory=InputLimits)
    prep_threads: int = 4  # threads that check limits and compile grammars
    prep_processes: int = 2  # processes that render chat templates and tokenize
    grammar_threads: int | None = (
        None  # None: grammar.grammar_threads (a quarter of the cores, 1-4)
    )
    stream_interval: int = 1  # output tokens a streamed chunk waits for (the first goes at once)
    switch_interval_ms: float = 5.0  # sys.setswitchinterval: the engine and HTTP threads' GIL
    api_server_count: int = 0  # 0: the HTTP door on a thread here; 1: in a process of its own
    log_level: str = "INFO"
    log_format: str = "text"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("--port must be a TCP port (0: any free one)")
        if self.drain_timeout_s < 0:
            raise ValueError("--drain-timeout must be >= 0 seconds")
        if self.max_active_requests < 1 or self.max_request_bytes < 1024:
            raise ValueError("--max-active-requests must be >= 1, --max-request-bytes >= 1024")
        d = self.limits
        if min(d.header_timeout_s, d.body_timeout_s, d.keep_alive_timeout_s) <= 0:
            raise ValueError(
                "--header-timeout, --body-timeout and --keep-alive-timeout must be > 0"
            )
        if d.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be >= 1")
        if self.prep_threads < 1 or self.prep_processes < 1:
            raise ValueError("--prep-threads and --prep-processes must be >= 1")
        if self.data_parallel_size > 1 and self.engine.worker_addr:
            raise ValueError("--data-parallel-size launches its workers: drop --worker")
        if self.grammar_threads is not None and not 0 <= self.grammar_threads <= 256:
            raise ValueError("--grammar-threads must be between 0 and 256")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.api_server_count not in (0, 1):
            raise ValueError(
                "--api-server-count must be 0 (the HTTP door on a thread of the scheduler) or 1 "
                "(in a process of its own); several HTTP processes are not supported"
            )
        if not 0 < self.switch_interval_ms <= 1000:
            raise ValueError("--switch-interval-ms must be > 0 and <= 1000")
        if self.log_format not in ("text", "json"):
            raise ValueError("--log-format must be text or json")
        if self.api_key_file is not None and not Path(self.api_key_file).is_file():
            raise ValueError(f"--api-key-file {self.api_key_file}: no such file")

    def api_key(self) -> str | None:
        if self.api_key_file is None:
            return None
        key = Path(self.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {self.api_key_file} is empty")
        return key


def parse_args(argv: list[str] | None) -> ServeConfig:
    ap = argparse.ArgumentParser(
        prog="specd-scheduler",
        description="The specd scheduler daemon: an OpenAI-compatible HTTP server that schedules "
        "requests, checks drafts against grammars and drives one specd worker over ZeroMQ.",
        epilog="Exit codes: 0 clean shutdown; 1 worker lost for good or loop failure; 2 bad "
        "configuration; 3 no worker (launch, connect or handshake failed).",
    )
    ap.add_argument(
        "--config",
        default=None,
        help="a TOML file of these options (keys as flag names, - or _); flags win",
    )
    ap.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one)")
    ap.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the worker's)",
    )
    ap.add_argument(
        "--api-key-file",
        default=None,
        help="file holding the key clients must send as 'Authorization: Bearer KEY' "
        "(/health and /metrics stay open)",
    )
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may finish before they are aborted",
    )
    ap.add_argument(
        "--max-active-requests",
        type=int,
        default=4096,
        help="requests queued or running at once; more are answered 503",
    )
    ap.add_argument("--max-request-bytes", type=int, default=16 << 20, help="largest HTTP body")
    ap.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's line and headers; then it is closed",
    )
    ap.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's body; then it gets 408",
    )
    ap.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    ap.add_argument(
        "--max-connections",
        type=int,
        default=8192,
        help="open HTTP connections at once; a request on one more gets 503",
    )
    ap.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="launch this many workers (worker i sees GPU i) behind this scheduler; each request "
        "goes to the worker with the fewest active requests",
    )
    ap.add_argument(
        "--prep-threads",
        type=int,
        default=4,
        help="threads that check requests against the limits and compile their grammars, off "
        "the engine's thread",
    )
    ap.add_argument(
        "--prep-processes",
        type=int,
        default=2,
        help="processes that render chat templates and tokenize prompts (the tokenizer holds "
        "the GIL, so threads would stall the engine)",
    )
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="stream a request's text every N output tokens (SGLang's and vLLM's flag): the "
        "first token goes at once, the rest in chunks of N and what is left at the end; fewer "
        "writes a step for the HTTP thread at many streams",
    )
    ap.add_argument(
        "--grammar-threads",
        type=int,
        default=None,
        help="threads of llguidance's pool that compute a step's grammar masks off the GIL "
        "(default: a quarter of the cores, 1 to 4; 0: one request at a time on the engine's "
        "thread)",
    )
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=5.0,
        help="how long a thread holding the GIL runs before a waiting one takes it (Python's "
        "sys.setswitchinterval, whose default this is): the engine's thread, back from a socket "
        "or grammar call, waits up to this long for the HTTP thread streaming tokens",
    )
    ap.add_argument(
        "--api-server-count",
        type=int,
        default=0,
        help="1: run the HTTP door (uvicorn, the SSE encoding, admission) in a process of its "
        "own, as vLLM's API server, so the engine's thread has the scheduler's GIL to itself; "
        "0: on a thread of the scheduler's process",
    )
    add_limit_args(ap)
    add_engine_args(ap)
    add_log_args(ap)
    a = parse_with_config(ap, glue_worker_args(argv))
    return ServeConfig(
        # the scheduler's Prometheus port (--metrics-port) listens where the HTTP door does
        engine=dataclasses.replace(engine_config(a), metrics_host=a.host),
        host=a.host,
        port=a.port,
        served_model_name=a.served_model_name,
        api_key_file=a.api_key_file,
        drain_timeout_s=a.drain_timeout,
        max_active_requests=a.max_active_requests,
        max_request_bytes=a.max_request_bytes,
        data_parallel_size=a.data_parallel_size,
        limits=DoorLimits(
            header_timeout_s=a.header_timeout,
            body_timeout_s=a.body_timeout,
            keep_alive_timeout_s=a.keep_alive_timeout,
            max_connections=a.max_connections,
        ),
        input_limits=input_limits(a),
        prep_threads=a.prep_threads,
        prep_processes=a.prep_processes,
        stream_interval=a.stream_interval,
        grammar_threads=a.grammar_threads,
        switch_interval_ms=a.switch_interval_ms,
        api_server_count=a.api_server_count,
        log_level=a.log_level,
        log_format=a.log_format,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)  # a bad limit raises ValueError here too
        api_key = cfg.api_key()
    except ValueError as e:
        print(f"specd-scheduler: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg.log_level, cfg.log_format)
    sys.setswitchinterval(cfg.switch_interval_ms / 1000)
    if cfg.grammar_threads is not None:
        set_grammar_threads(cfg.grammar_threads)
    where = (
        cfg.engine.worker_addr
        or f"{cfg.data_parallel_size} launched worker(s) ({cfg.engine.model})"
    )
    log.info("starting: %s", where)
    with contextlib.ExitStack() as stack:
        try:
            engines = [
                stack.enter_context(Engine(worker_config(cfg, i)))
                for i in range(cfg.data_parallel_size)
            ]
        except (WorkerDied, HandshakeError, OSError, ValueError) as e:
            log.error("no worker: %s", e)
            return EXIT_WORKER
        prep = stack.enter_context(contextlib.closing(preparer(cfg, engines[0])))
        loops = [EngineLoop(e, prep, cfg.stream_interval) for e in engines]
        return serve(cfg, api_key, loops)


def preparer(cfg: ServeConfig, engine: Engine) -> Preparer:
    """One for all the engines: data-parallel workers serve the same model and tokenizer."""
    return Preparer(
        tokenizer_dir=engine.tokenizer.directory if engine.tokenizer is not None else None,
        grammar=engine.scheduler.grammar,
        limits=cfg.input_limits,
        max_model_len=engine.ready.max_model_len,
        num_threads=cfg.prep_threads,
        num_processes=cfg.prep_processes,
    )


def worker_config(cfg: ServeConfig, index: int) -> EngineConfig:
    """Worker ``index`` of a data-parallel group sees only GPU ``index``."""
    if cfg.data_parallel_size == 1:
        return cfg.engine
    return dataclasses.replace(cfg.engine, worker_env=(("CUDA_VISIBLE_DEVICES", str(index)),))


class _Front(Protocol):
    failed: str | None

    def start(self) -> tuple[str, int]: ...

    def stop(self) -> None: ...


class _DoorThread:
    """The HTTP door on a thread of this process (``--api-server-count 0``)."""

    failed: str | None = None

    def __init__(self, door: Door, cfg: ServeConfig) -> None:
        self.door = door
        try:
            self.server = DoorServer(door, cfg.host, cfg.port, cfg.limits)
        except OSError as e:
            raise OSError(f"cannot listen on {cfg.host}:{cfg.port}: {e}") from None

    def start(self) -> tuple[str, int]:
        self.server.start()
        return self.server.address

    def stop(self) -> None:
        self.door.alive = False
        self.server.stop()


def front(cfg: ServeConfig, api_key: str | None, loops: list[EngineLoop], model: str) -> _Front:
    """The HTTP door for ``loops``: on a thread here, or in its own process."""
    ready = loops[0].engine.ready
    registry = merged_registry([lp.engine.prom.registry for lp in loops])
    # the Door's settings, for this process's Door or the HTTP process's (as JSON)
    door_settings: dict[str, Any] = {
        "model": model,
        "max_model_len": ready.max_model_len,
        "vocab_size": ready.vocab_size,
        "api_key": api_key,
        "max_request_bytes": cfg.max_request_bytes,
        "max_active_requests": cfg.max_active_requests,
        "body_timeout_s": cfg.limits.body_timeout_s,
    }
    if cfg.api_server_count == 1:
        return ApiServerProcess(
            loops,
            registry,
            {
                "door": door_settings,
                "host": cfg.host,
                "port": cfg.port,
                "limits": dataclasses.asdict(cfg.limits),
                "log_level": cfg.log_level,
                "log_format": cfg.log_format,
            },
        )

    async def metrics() -> bytes:
        return bytes(generate_latest(registry))

    return _DoorThread(Door(loops, metrics=metrics, **door_settings), cfg)


def serve(cfg: ServeConfig, api_key: str | None, loops: list[EngineLoop]) -> int:
    """HTTP in one thread (or process), engine loop 0 on this thread, the others on their own."""
    ready = loops[0].engine.ready
    model = cfg.served_model_name or ready.model_name
    # the tokenizer, the grammar engine, the modules: out of each step's collections, frozen
    # before the door opens or another loop starts (protocol/gc_heap.py)
    frozen = freeze_heap()
    try:
        http = front(cfg, api_key, loops, model)
        host, port = http.start()
    except OSError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    errors: list[BaseException] = []

    def run_other(loop: EngineLoop) -> None:
        try:
            loop.run()
        except Exception as e:  # reported by the main thread
            log.exception("fatal error in a scheduler loop")
            errors.append(e)

    others = [
        threading.Thread(target=run_other, args=(lp,), name=f"engine-{i + 1}")
        for i, lp in enumerate(loops[1:])
    ]
    for t in others:
        t.start()

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: draining", signum)
        for lp in loops:
            lp.drain(cfg.drain_timeout_s)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sched = loops[0].engine.scheduler
    log.info(
        "ready: http://%s:%d (model %s, drafter %s, k=%d, %d worker(s), %s, %d objects frozen)",
        host,
        port,
        model,
        ready.drafter,
        ready.max_num_speculative_tokens,
        len(loops),
        # the mode, chosen from the worker's handshake where the user left it
        f"overlap with {sched.max_steps_in_flight} steps in flight"
        + (", the worker's steps left open" if ready.pipeline_steps else "")
        if sched.async_scheduling
        else "sync",
        frozen,
    )
    try:
        loops[0].run()
        for lp in loops[1:]:  # loop 0 ended (drained, or its worker is lost): the others follow
            lp.drain(cfg.drain_timeout_s)
        for t in others:
            t.join()
    except Exception:
        log.exception("fatal error in the scheduler loop")
        for lp in loops[1:]:  # ended before the door stops: it then owns their pipes alone
            lp.drain(0.0)
        for t in others:
            t.join(timeout=30)
        return EXIT_FATAL
    finally:
        http.stop()
    if http.failed:
        log.error("stopped: %s", http.failed)
        return EXIT_FATAL
    if errors or any(lp.failed for lp in loops):
        return EXIT_FATAL
    log.info("drained; stopping the worker(s)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
