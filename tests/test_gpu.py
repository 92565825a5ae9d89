"""GPU checks (marked gpu; skipped without CUDA): the same losslessness in float32 on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.driver import Req, run
from tests.models import greedy_reference, reference_copy, tiny_model
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("graphs", "compiled"),
    [(True, False), (False, False), (True, True)],
    ids=["cuda-graphs", "eager", "cuda-graphs-compiled"],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_fp32_ngram_greedy_equals_target_greedy(
    arch: str, graphs: bool, compiled: bool
) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    target = tiny_model(arch, seed=21).to(dev)
    ref = reference_copy(target.cpu()).eval()
    target = target.to(dev)
    runner = ModelRunner(
        ModelExecutor(
            target,
            max_num_seqs=4,
            max_model_len=128,
            decode_width=5,
            cuda_graphs=graphs,
            compile_layers=compiled,
        ),
        NgramDrafter(min_n=1, max_n=3, max_num_tokens=4),
        max_num_seqs=4,
        max_model_len=128,
        max_num_draft_tokens=4,
    )
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12], [3, 4, 3, 4, 3, 4, 3, 4, 3]]
    reqs = [Req(f"r{i}", p, 20, k=4, arrive=i) for i, p in enumerate(prompts)]
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens)
    decode = runner.target.decode
    assert decode.num_forwards > 0
    assert (decode.num_captured > 0) == graphs, "decode steps must replay captured graphs"
    ragged = runner.target.ragged  # the paged kernel's: prefill and mixed steps
    assert ragged is not None and ragged.num_forwards > 0
    assert (ragged.num_captured > 0) == graphs, "mixed steps must replay captured graphs"


def test_capturing_every_shape_keeps_the_kv_cache_out_of_autograd() -> None:
    """A model built from a config wants gradients; capture_all used to run its warm-ups with
    autograd on, and every forward's history hung off the KV cache (8B at batch 64 ran out of
    the H200's memory while capturing)."""
    dev = torch.device("cuda")
    target = tiny_model("llama", seed=22).to(dev)
    target.requires_grad_(True)
    ex = ModelExecutor(target, max_num_seqs=4, max_model_len=128, decode_width=3)
    assert ex.decode.capture_all(100) > 0
    assert ex.ragged is not None and ex.ragged.capture_all() > 0
    assert all(t.grad_fn is None and not t.requires_grad for t in ex.kv_cache.keys)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_cuda_fp32_open_steps_greedy_equals_target_greedy(graphs: bool) -> None:
    """--pipeline-steps on the device: each step launched behind an open one (its tokens read on
    the device, their copy to pinned memory behind the kernels, an event per step), through a
    mixed step and a slot taken while a step is open (tests/test_pipeline_steps.py)."""
    from tests.test_pipeline_steps import run_arrivals_and_a_taken_slot
    from worker.drafters.base import NoDrafter

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    target = tiny_model("llama", seed=22)
    ref = reference_copy(target).eval()
    runner = ModelRunner(
        ModelExecutor(
            target.to(torch.device("cuda")), max_num_seqs=2, max_model_len=128, cuda_graphs=graphs
        ),
        NoDrafter(),
        max_num_seqs=2,
        max_model_len=128,
        max_num_draft_tokens=0,
    )
    run_arrivals_and_a_taken_slot(runner, ref)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_cuda_fp32_chained_drafting_steps_greedy_equal_target_greedy(graphs: bool) -> None:
    """--chain-drafts on the device: prompt lookup's drafting steps left open, verified and
    proposed after on the device, the next step's positions, cache rows and first token written
    into the decode graph's inputs there (tests/test_chain_drafts.py)."""
    from tests.test_chain_drafts import check_chained

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    check_chained("cuda", graphs)


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "eagle"])
def test_cuda_fp32_a_drafter_turned_down_to_zero_leaves_its_steps_open(kind: str) -> None:
    """--pipeline-steps with a drafter whose proposals the tuner caps at zero on most steps: the
    held steps' tokens read back late, the EAGLE head fed from held steps; the same output,
    drafts and proposals as with every step closed, and target-only greedy."""
    from tests.test_pipeline_steps import check_drafter_turned_down

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    check_drafter_turned_down(kind, "cuda", widths_are_caps=True)


def test_cuda_fp32_long_contexts_replay_the_graphs_captured_before_the_first_request() -> None:
    """With the paged kernel a decode graph serves every context length: contexts past the
    shortest length bucket run lossless without a capture after ``capture_all``."""
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    target = tiny_model("llama", seed=23).to(dev)
    ref = reference_copy(target.cpu()).eval()
    target = target.to(dev)
    executor = ModelExecutor(target, max_num_seqs=2, max_model_len=1024, decode_width=4)
    assert executor.kernel and not executor.decode.length_buckets
    captured = executor.decode.capture_all()
    assert captured == executor.decode.num_captured > 0
    runner = ModelRunner(
        executor,
        NgramDrafter(min_n=1, max_n=3, max_num_tokens=3),
        max_num_seqs=2,
        max_model_len=1024,
        max_num_draft_tokens=3,
    )
    prompts = [[5, 6, 7, 8] * 150, [9, 10, 11] * 90]  # 600 and 270 tokens
    reqs = [Req(f"r{i}", p, 24, k=3) for i, p in enumerate(prompts)]
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens)
    assert executor.decode.num_forwards > 0
    assert executor.decode.num_captured == captured, "a long context captured a new graph"


def test_cuda_fp32_eagle_drafting_graphs_replay_what_runs_eagerly() -> None:
    """The EAGLE head's drafting graphs (eagle_graphs.py) and catch-up graphs (ragged_graphs.py)
    propose the drafts the same layouts propose run eagerly, step by step, and the output is
    target-only greedy."""
    from tests.test_eagle import drafting_logs

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    replayed, eager = drafting_logs("cuda", [(True, True, True), (True, False, True)])
    assert replayed == eager


@pytest.mark.parametrize("drafter", ["none", "ngram", "ngram-chain"])
def test_cuda_served_worker_left_to_its_defaults_stays_greedy(
    drafter: str, target_dir: Path, tmp_path: Path
) -> None:
    """A launched CUDA worker and a scheduler given no mode flags (the served path's defaults;
    float32 for the comparison): the worker's handshake says it leaves steps open, the scheduler
    runs overlap with three steps in flight, steps are pipelined, chats equal target-only greedy
    and structured greedy requests the sync CPU engine's. ``ngram-chain``: with --chain-drafts,
    prompt lookup's drafting steps left open too."""
    chain = ("--chain-drafts",) if drafter.endswith("-chain") else ()
    drafter = drafter.removesuffix("-chain")
    from tests.test_overlap import check_greedy, check_structured_greedy
    from tests.test_pipeline_steps import worker_metric
    from tests.test_scheduler_e2e import engine, started_together

    log = tmp_path / "worker.log"
    flags = ("--dtype", "float32", "--metrics-port", "-1", *chain)
    sync, served = started_together(
        lambda: engine(target_dir, drafter),
        lambda: engine(
            target_dir,
            drafter,
            async_scheduling=None,
            max_steps_in_flight=None,
            device="cuda",
            worker_args=flags,
            worker_log=str(log),
        ),
    )
    try:
        assert served.ready.pipeline_steps and served.overlap
        mode = served.scheduler.async_scheduling, served.scheduler.max_steps_in_flight
        assert mode == (True, 3)
        check_greedy(served, 8)
        check_structured_greedy(sync, served)
        assert served.num_worker_restarts == 0
        if drafter == "none":  # n-gram's steps are left open only where it proposes nothing
            assert worker_metric(log, "specd_worker_pipelined_steps_total") > 0
        if chain:
            assert worker_metric(log, "specd_worker_chained_steps_total") > 0
    finally:
        sync.close()
        served.close()
