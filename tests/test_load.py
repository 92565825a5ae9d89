"""Many concurrent requests through one scheduler and one worker: all complete, none lost or
duplicated. ``SPECD_LOAD_REQUESTS`` sets the count (1,000 in the benchmark run)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from scheduler_client import Engine, EngineConfig, SchedulerConfig
from tests.models import save_byte_model

NUM_REQUESTS = int(os.environ.get("SPECD_LOAD_REQUESTS", "200"))


def test_concurrent_requests_all_complete(tmp_path: Path) -> None:
    model = save_byte_model("llama", 41, tmp_path / "model")
    cfg = EngineConfig(
        model=str(model),
        drafter="ngram",
        device="cpu",
        max_model_len=64,
        worker_max_num_seqs=32,
        step_timeout_s=60,
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024),
    )
    with Engine(cfg) as e:
        t0 = time.monotonic()
        reqs = [
            e.add_request(
                f"request {i % 10} says hi",
                max_tokens=4,
                ignore_eos=True,
                num_speculative_tokens=i % 3,
                req_id=f"load-{i}",
            )
            for i in range(NUM_REQUESTS)
        ]
        e.run_until_done()
        dt = time.monotonic() - t0
        assert len({r.req_id for r in reqs}) == NUM_REQUESTS
        assert all(r.error is None and r.finish_reason == "length" for r in reqs)
        assert all(len(r.output_ids) == 4 for r in reqs)
        assert not e.scheduler.running and not e.scheduler.waiting
        # same prompt, same greedy output, whatever the batch it ran in
        by_prompt = {}
        for r in reqs:
            by_prompt.setdefault(tuple(r.prompt_ids), r.output_ids)
            assert by_prompt[tuple(r.prompt_ids)] == r.output_ids
        print(f"{NUM_REQUESTS} requests in {dt:.1f} s: {NUM_REQUESTS / dt:.1f} requests/s")
