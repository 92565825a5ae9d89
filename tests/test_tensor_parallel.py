"""Tensor parallelism on CPU: two processes with gloo give the same greedy output as one."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tests.driver import Req, run
from tests.models import greedy_reference, reference_copy, save_byte_model, tiny_model
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner
from worker.tensor_parallel import ColumnParallelLinear, check_shardable, shard_model

K = 4
PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12, 13], [3, 4, 3, 4, 3, 4, 3, 4]]


def requests(k: int) -> list[Req]:
    return [Req(f"r{i}", p, 16 + 2 * i, k=k, arrive=i) for i, p in enumerate(PROMPTS)]


def generate(model: torch.nn.Module, drafter: str) -> dict[str, list[int]]:
    k = K if drafter == "ngram" else 0
    d: Drafter = NgramDrafter(min_n=1, max_n=3, max_num_tokens=K) if k else NoDrafter()
    runner = ModelRunner(
        ModelExecutor(model, max_num_seqs=4, max_model_len=128, decode_width=1 + k),
        d,
        max_num_seqs=4,
        max_model_len=128,
        max_num_draft_tokens=max(k, 1),
    )
    return run(runner, requests(k))


def rank_main(rank: int, world: int, init: str, arch: str, drafter: str, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = tiny_model(arch, seed=71)  # the same seed: the same full weights on every rank
        kv_heads = shard_model(model, rank, world)
        q = model.get_decoder().layers[0].self_attn.q_proj
        assert isinstance(q, ColumnParallelLinear) and q.weight.shape[0] == 64 // world
        assert kv_heads == 2 // world
        got = generate(model, drafter)
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


# Each pair spawns two ranks (~10 s on 2 cores): `make test` runs one (qwen2: its q/k/v biases
# are sharded too; test_faults.py's TP daemon runs a Llama), `make test-long` the rest.
TP_CASES = [
    ("qwen2", "ngram"),
    *(pytest.param(a, d, marks=pytest.mark.long) for a, d in [
        ("llama", "none"), ("llama", "ngram"), ("qwen2", "none")
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "drafter"), TP_CASES)
def test_tp2_with_gloo_equals_tp1(arch: str, drafter: str, tmp_path: Path) -> None:
    single = generate(tiny_model(arch, seed=71), drafter)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"  # a file store: no TCP port to pick and race for
    procs = [ctx.Process(target=rank_main, args=(r, 2, init, arch, drafter, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = dict(out.get(timeout=240) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        # a rank that hangs (its peer died in a collective) is stopped, not left behind
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(timeout=30)
        out.close()
        out.join_thread()
    assert results[0] == results[1] == single
    ref = reference_copy(tiny_model(arch, seed=71))
    for r in requests(0):
        assert single[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens)


def test_a_size_the_group_does_not_divide_is_named() -> None:
    model = tiny_model("llama", seed=1)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_shardable(model.config, 4)


def daemon_outputs(
    model: Path, tp: str, work: list[dict[str, Any]], log_dir: Path, overlap: bool = False
) -> list[list[int]]:
    """``work`` through a launched ``specd-worker --tensor-parallel-size tp`` (CPU, gloo)."""
    from scheduler_client import Engine, EngineConfig, SchedulerConfig

    cfg = EngineConfig(
        model=str(model),
        device="cpu",
        max_model_len=128,
        worker_args=("--tensor-parallel-size", tp),
        worker_log=str(log_dir / f"worker{tp}.log"),
        scheduler=SchedulerConfig(async_scheduling=overlap),
    )
    with Engine(cfg) as e:
        done = e.generate([dict(w) for w in work])
        assert all(r.error is None for r in done), [r.error for r in done]
        for w, r in zip(work, done, strict=True):
            if "structured" in w:
                jsonschema.validate(json.loads(r.text), w["structured"]["json"])
        if overlap and any("structured" in w for w in work):
            assert e.num_deferred_bitmasks > 0
        return [r.output_ids for r in done]


@pytest.mark.long
def test_worker_daemon_with_two_ranks_serves_the_same_greedy_text(tmp_path: Path) -> None:
    """``specd-worker --tensor-parallel-size 2`` on CPU: rank 0 serves the scheduler and
    broadcasts each step to rank 1 (a process it launched); the output equals one process's."""
    model = save_byte_model("llama", 72, tmp_path / "m")
    work = [{"prompt": p, "max_tokens": 16, "ignore_eos": True} for p in ("abcabc", "xyz")]
    assert daemon_outputs(model, "1", work, tmp_path) == daemon_outputs(model, "2", work, tmp_path)


@pytest.mark.long
def test_two_ranks_with_overlap_scheduling_and_deferred_rows(tmp_path: Path) -> None:
    """Overlap scheduling against a TP=2 worker: rank 0 relays each deferred StepBitmask to rank 1.
    A structured greedy request (its rows deferred) and a plain one give the same output as one
    process in sync mode."""
    model = save_byte_model("llama", 73, tmp_path / "m")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 5}},
        "required": ["n", "s"],
    }
    work = [
        {"prompt": "json: ", "max_tokens": 60, "structured": {"json": schema}},
        {"prompt": "abcabcabc", "max_tokens": 24, "ignore_eos": True},
    ]
    sync_one = daemon_outputs(model, "1", work, tmp_path)
    assert daemon_outputs(model, "2", work, tmp_path, overlap=True) == sync_one
