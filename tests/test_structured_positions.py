"""Structured requests at every batch position, mixed with plain ones, under every drafter, in sync
and overlap mode: each structured output matches its grammar and every greedy output equals the
same request run alone with no drafter. A grammar row placed on another request's logit rows shows
up here as a wrong output (a plain request constrained, a structured one let loose).

Two real processes over ipc://, CPU, the tiny byte-level models, llguidance. One worker per drafter
(launched together); the sync and the overlap scheduler connect to it in turn."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from scheduler_client import Engine, EngineConfig, SchedulerConfig
from tests.procs import start_worker

DRAFTERS = ["none", "ngram", "draft_model", "eagle", "parallel"]
MASK_ID = 257  # <|im_start|>: the parallel drafter's mask token
SCHEMA = {
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["age", "ok"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CODE = r"[a-c]{3}-\d{2}"
# Structured at positions 0, 2 and 4 (first, middle, last), plain between; the plain ones finish
# at different steps, so the structured requests' positions move as the batch shrinks.
BATCH: list[dict[str, Any]] = [
    {"prompt": "json", "max_tokens": 60, "structured": {"json": SCHEMA}},
    {"prompt": list(b"the cat sat on the mat. the cat sat"), "max_tokens": 24, "ignore_eos": True},
    {"prompt": "phone", "max_tokens": 40, "structured": {"regex": PHONE}},
    {"prompt": list(b"abcabcabcabc"), "max_tokens": 9, "ignore_eos": True},
    {"prompt": "code", "max_tokens": 40, "structured": {"regex": CODE}},
]


def check_grammar(work: dict[str, Any], text: str) -> None:
    spec = work["structured"]
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    else:
        assert re.fullmatch(spec["regex"], text), text


@pytest.fixture(scope="module")
def workers(
    target_dir: Path, draft_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """drafter -> the address of a worker serving it, all started at once."""
    import torch
    from transformers import AutoConfig

    from tests.models import BYTE_MODEL_SEED, save_byte_model
    from worker.attention import ATTN_IMPLEMENTATION
    from worker.eagle_head import EagleHead, head_config

    tmp = tmp_path_factory.mktemp("workers")
    head = tmp / "head"
    torch.manual_seed(4)  # a random head: lossless with any weights
    EagleHead(head_config(AutoConfig.from_pretrained(target_dir)), ATTN_IMPLEMENTATION).save(head)
    parallel = save_byte_model("llama", BYTE_MODEL_SEED + 1, tmp / "parallel", layers=1)
    cfg = json.loads((parallel / "config.json").read_text())
    (parallel / "config.json").write_text(json.dumps({**cfg, "mask_token_id": MASK_ID}))
    extra = {
        "none": [],
        "ngram": [],
        "draft_model": ["--draft-model", str(draft_dir)],
        "eagle": ["--eagle-head", str(head)],
        "parallel": ["--draft-model", str(parallel)],
    }
    procs: list[subprocess.Popen[bytes]] = []
    addrs = {}
    try:
        for d in DRAFTERS:
            addrs[d] = f"ipc://{tmp / d}.sock"
            flags = ["--drafter", d, "--num-speculative-tokens", "4", "--max-model-len", "384"]
            procs.append(start_worker(target_dir, addrs[d], *flags, *extra[d]))
        yield addrs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


def connect(addr: str, overlap: bool) -> Engine:
    return Engine(
        EngineConfig(
            worker_addr=addr,
            scheduler=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=512,
                max_prefill_chunk=48,
                async_scheduling=overlap,
            ),
            step_timeout_s=60,
        )
    )


@pytest.fixture(scope="module")
def alone(workers: dict[str, str]) -> list[list[int]]:
    """Each request of BATCH run alone, no drafter, sync: the greedy outputs to match."""
    with connect(workers["none"], overlap=False) as e:
        outs = []
        for work in BATCH:
            (r,) = e.generate([dict(work)])
            assert r.error is None, r.error
            outs.append(r.output_ids)
        return outs


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_structured_at_every_position_is_valid_and_lossless(
    workers: dict[str, str], alone: list[list[int]], drafter: str, overlap: bool
) -> None:
    with connect(workers[drafter], overlap) as e:
        assert e.overlap == overlap
        reqs = e.generate([dict(w) for w in BATCH])
        for i, (work, r) in enumerate(zip(BATCH, reqs, strict=True)):
            assert r.error is None, (i, r.error)
            if "structured" in work:
                assert r.finish_reason == "stop", (i, r.finish_reason, r.text)
                check_grammar(work, r.text)
            assert r.output_ids == alone[i], f"position {i} differs from its run alone"
        if drafter != "none":
            assert e.scheduler.metrics.num_draft_tokens > 0, "no draft was verified"
        if overlap:
            assert e.num_deferred_bitmasks > 0, "no structured step was deferred"
