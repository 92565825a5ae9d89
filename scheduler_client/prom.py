"""The scheduler's Prometheus metrics (``EngineConfig.metrics_port``)."""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from protocol.gc_heap import GcCollector
from scheduler_client.request import Request
from scheduler_client.spec_guard import SpeculationGuard
from scheduler_client.spec_tuner import SpeculationTuner

# seconds: a request's phases, from a queue of a millisecond to a decode of half a minute
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


def merged_registry(registries: list[CollectorRegistry]) -> CollectorRegistry:
    """One registry for /metrics: the engines' metrics (with one worker its own; with several,
    every sample labelled ``worker="i"`` under one family per metric: duplicate families would
    be invalid), and the process's garbage collector once, unlabelled (``GcCollector``)."""

    class Merged:
        def collect(self) -> Iterator[Metric]:
            if len(registries) == 1:
                yield from registries[0].collect()
                return
            families: dict[str, Metric] = {}
            for i, reg in enumerate(registries):
                for fam in reg.collect():
                    out = families.setdefault(
                        fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    )
                    for smp in fam.samples:
                        labels = {**smp.labels, "worker": str(i)}
                        out.add_sample(smp.name, labels, smp.value, smp.timestamp, smp.exemplar)
            yield from families.values()

    merged = CollectorRegistry()
    merged.register(Merged())
    merged.register(GcCollector("specd_scheduler_"))
    return merged


class SchedulerMetrics:
    def __init__(self) -> None:
        self.server: WSGIServer | None = None  # the /metrics listener, once served
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            "specd_scheduler_step_seconds",
            "Wall time of one step, worker round trip included",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.queue_depth = Gauge("specd_scheduler_queue_depth", "Requests waiting", registry=r)
        self.running = Gauge("specd_scheduler_running_requests", "Requests running", registry=r)
        self.finished = Counter(
            "specd_scheduler_requests_finished_total",
            "Finished requests, by reason",
            ["reason"],
            registry=r,
        )
        self.tokens = Counter("specd_scheduler_output_tokens_total", "Tokens committed", registry=r)
        self.drafts = Counter(
            "specd_scheduler_drafts_total",
            "Verifications that carried at least one draft",
            registry=r,
        )
        self.draft_tokens = Counter(
            "specd_scheduler_draft_tokens_total", "Drafts verified", registry=r
        )
        self.accepted = Counter(
            "specd_scheduler_accepted_tokens_total", "Drafts accepted", registry=r
        )
        self.accepted_pos = Counter(
            "specd_scheduler_accepted_per_position_total",
            "Drafts accepted, by position",
            ["position"],
            registry=r,
        )
        self.grammar_invalid = Counter(
            "specd_scheduler_grammar_invalid_drafts_total",
            "Drafts dropped because the grammar forbids them",
            registry=r,
        )
        self.forced = Counter(
            "specd_scheduler_grammar_forced_drafts_total",
            "Grammar-forced drafts offered",
            registry=r,
        )
        self.stale = Counter(
            "specd_scheduler_stale_draft_messages_total",
            "Draft messages discarded for a wrong step or length",
            registry=r,
        )
        self.worker_restarts = Counter(
            "specd_scheduler_worker_restarts_total", "Workers replaced after a death", registry=r
        )
        self.preemptions = Gauge(
            "specd_scheduler_preemptions",
            "Running requests preempted for want of KV blocks (recomputed later), since start",
            registry=r,
        )
        # a finished request's time in each phase (vLLM's request_queue_time_seconds and kin)
        self.phase_seconds = {
            name: Histogram(
                f"specd_scheduler_request_{name}_seconds",
                text,
                registry=r,
                buckets=PHASE_BUCKETS,
            )
            for name, text in (
                ("prep", "Preparation: limits, chat template, tokenizing, grammar"),
                ("queue", "Prepared to its first step (waiting for admission)"),
                ("prefill", "Its first step to its first token"),
                ("decode", "Its first token to its end"),
            )
        }

    def watch_tuner(self, tuner: SpeculationTuner, guard: SpeculationGuard | None = None) -> None:
        """Export the speculation tuner's measured step times, and the guard's judgement (its
        windows' output tokens a second), read at each scrape."""

        class TunerView:
            def collect(self) -> Iterator[Metric]:
                seconds = GaugeMetricFamily(
                    "specd_scheduler_tuner_step_seconds",
                    "The speculation tuner's step time at no prefill, by batch bucket and width "
                    "(1 + drafts verified)",
                    labels=["batch", "width"],
                )
                samples = GaugeMetricFamily(
                    "specd_scheduler_tuner_samples",
                    "Steps behind each of the tuner's step times",
                    labels=["batch", "width"],
                )
                for b, w, t, n in tuner.snapshot():
                    seconds.add_metric([str(b), str(w)], t)
                    samples.add_metric([str(b), str(w)], n)
                yield seconds
                yield samples
                yield GaugeMetricFamily(
                    "specd_scheduler_tuner_calibration",
                    "Drafts accepted for each token the tuner's model expected verified drafts to "
                    "add, over recent verify steps (at most 1): it scales the model's expectation",
                    value=tuner.calibration,
                )
                if guard is None:
                    return
                preferred = GaugeMetricFamily(
                    "specd_scheduler_speculation_guard_preferred",
                    "1 where the guard lets the tuner draft, 0 where drafting lost to windows "
                    "without it (spec_guard.py), by batch bucket",
                    labels=["batch"],
                )
                rates = GaugeMetricFamily(
                    "specd_scheduler_speculation_guard_tokens_per_second",
                    "Output tokens a second of the guard's windows (moving average), by batch "
                    "bucket and kind (drafting: as the tuner decides; off: no drafts)",
                    labels=["batch", "kind"],
                )
                for batch, judged in sorted(guard.buckets.items()):
                    preferred.add_metric([str(batch)], float(judged.prefer))
                    if judged.num_on:
                        rates.add_metric([str(batch), "drafting"], judged.on)
                    if judged.num_off:
                        rates.add_metric([str(batch), "off"], judged.off)
                yield preferred
                yield rates
                yield CounterMetricFamily(
                    "specd_scheduler_speculation_guard_switches",
                    "Times the guard turned drafting off or back on (any batch bucket)",
                    value=guard.num_switches,
                )

        self.registry.register(TunerView())

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host``:``port`` (-1: any free port) until ``stop``; returns the
        port."""
        registry = merged_registry([self.registry])  # with the process's garbage collector
        self.server, _thread = start_http_server(max(port, 0), addr=host, registry=registry)
        return int(self.server.server_port)

    def stop(self) -> None:
        """Close the ``/metrics`` listener, if ``serve`` opened one."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def record_finished(self, req: Request) -> None:
        """Fold a finished request's totals in (counted once, at the end)."""
        m = req.metrics
        self.finished.labels(reason=req.finish_reason or "unknown").inc()
        self.tokens.inc(m.num_output_tokens)
        self.drafts.inc(m.num_drafts)
        self.draft_tokens.inc(m.num_draft_tokens)
        self.accepted.inc(m.num_accepted)
        for pos, n in enumerate(m.accepted_per_position):
            if n:
                self.accepted_pos.labels(position=str(pos)).inc(n)
        self.grammar_invalid.inc(m.num_grammar_invalid)
        self.forced.inc(m.num_forced)
        self.stale.inc(m.num_stale)
        for name, seconds in m.phases().items():
            self.phase_seconds[name].observe(seconds)
