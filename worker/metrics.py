"""The worker's Prometheus metrics (``--metrics-port``), updated by the step loop."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from protocol.gc_heap import GcCollector
from protocol.messages import ModelRunnerOutput


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            "specd_worker_step_seconds",
            "Time to execute one step",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.batch_size = Histogram(
            "specd_worker_batch_size",
            "Requests per step",
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.steps = Counter("specd_worker_steps_total", "Steps executed", registry=r)
        self.tokens = Counter("specd_worker_sampled_tokens_total", "Tokens sampled", registry=r)
        self.drafts = Counter(
            "specd_worker_drafts_total", "Verifications that carried at least one draft", registry=r
        )
        self.draft_tokens = Counter(
            "specd_worker_draft_tokens_total", "Drafts verified", registry=r
        )
        self.accepted = Counter("specd_worker_accepted_tokens_total", "Drafts accepted", registry=r)
        self.accepted_pos = Counter(
            "specd_worker_accepted_per_position_total",
            "Drafts accepted, by position in the draft",
            ["position"],
            registry=r,
        )
        self.pipelined = Counter(
            "specd_worker_pipelined_steps_total",
            "Steps launched while the step before was still open (--pipeline-steps)",
            registry=r,
        )
        self.chained = Counter(
            "specd_worker_chained_steps_total",
            "Steps that verify or propose drafts left open (--chain-drafts)",
            registry=r,
        )
        self.running = Gauge(
            "specd_worker_running_requests", "Requests holding a KV slot", registry=r
        )
        self.kv_blocks_free = Gauge(
            "specd_worker_kv_blocks_free", "Free blocks of the target's paged KV cache", registry=r
        )
        self.errors = Counter(
            "specd_worker_errors_total", "WorkerErrors sent, by code", ["code"], registry=r
        )
        r.register(GcCollector("specd_worker_"))

    def serve(self, port: int) -> int:
        """Serve ``/metrics`` on ``port`` (-1: any free port); returns the port it bound."""
        server, _thread = start_http_server(max(port, 0), registry=self.registry)
        return int(server.server_port)

    def record_step(
        self, out: ModelRunnerOutput, seconds: float, running: int, kv_blocks_free: int = 0
    ) -> None:
        self.steps.inc()
        self.kv_blocks_free.set(kv_blocks_free)
        self.step_seconds.observe(seconds)
        self.batch_size.observe(len(out.req_ids))
        self.running.set(running)
        self.tokens.inc(int(out.num_sampled.sum()))
        for w, a in zip(out.num_draft_tokens.tolist(), out.num_accepted.tolist(), strict=True):
            if w <= 0:
                continue
            self.drafts.inc()
            self.draft_tokens.inc(w)
            self.accepted.inc(a)
            for pos in range(a):
                self.accepted_pos.labels(position=str(pos)).inc()
