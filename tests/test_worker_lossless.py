"""Lossless: greedy speculative output equals target-only greedy output, token for token (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.driver import Req, run
from tests.models import VOCAB, greedy_reference, reference_copy, tiny_model
from worker.drafters.base import Drafter, NoDrafter
from worker.drafters.draft_model import DraftModelDrafter
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner

MAX_LEN = 160
K = 4


def make_runner(
    target: torch.nn.Module,
    drafter_kind: str,
    arch: str,
    max_num_seqs: int = 8,
    batch_invariant: str = "off",
    compile_layers: bool = False,
) -> ModelRunner:
    drafter: Drafter
    if drafter_kind == "none":
        drafter = NoDrafter()
    elif drafter_kind == "ngram":
        drafter = NgramDrafter(min_n=1, max_n=3, max_num_tokens=K)
    else:
        draft = tiny_model(arch, seed=99, layers=1)
        drafter = DraftModelDrafter(
            ModelExecutor(
                draft, max_num_seqs=max_num_seqs, max_model_len=MAX_LEN, decode_width=1 + K
            ),
            max_num_tokens=K,
        )
    return ModelRunner(
        ModelExecutor(
            target,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_LEN,
            batch_invariant=batch_invariant,
            decode_width=1 + K,
            compile_layers=compile_layers,
        ),
        drafter,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=K,
    )


def prompts(n: int, seed: int) -> list[list[int]]:
    """Mixed lengths; some repeat themselves so n-gram lookup finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        base = rng.integers(3, VOCAB, int(rng.integers(3, 12))).tolist()
        out.append((base * (1 + i % 3))[: 4 + 5 * i % 29])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter_kind", ["none", "ngram", "draft_model"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_speculative_equals_target_greedy(arch: str, drafter_kind: str, batch: int) -> None:
    seed = 1000 * batch + len(arch)
    print(f"seed={seed}")
    target = tiny_model(arch, seed=seed)
    ref = reference_copy(target)
    runner = make_runner(target, drafter_kind, arch)
    reqs = []
    for i, p in enumerate(prompts(batch, seed)):
        reqs.append(
            Req(
                req_id=f"r{i}",
                prompt=p,
                max_tokens=12 + 3 * i,
                k=[0, 1, 2, 3, 4][i % 5] if batch > 1 else K,  # mixed lengths, including 0
                arrive=2 * i
                if batch > 1
                else 0,  # joining mid-run (and leaving at different steps)
                chunk=5 if i % 2 else 0,  # chunked prefill for some
            )
        )
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id
    if drafter_kind != "none" and batch > 1:
        assert sum(r.verified for r in reqs) > 0, "no drafts were verified: the test proves nothing"
    # every slot comes back once requests leave
    assert len(runner.states.free_slots) == runner.states.max_num_seqs
    assert runner.target.decode.num_forwards > 0, "no step took the padded decode layout"
    # the paged kernel's (CUDA, or SPECD_ATTENTION_BACKEND=triton)
    if runner.target.ragged is not None:
        assert runner.target.ragged.num_forwards > 0, "no step took the ragged graphs' layout"


def test_ngram_accepts_on_repetitive_text() -> None:
    """A sequence the model repeats: n-gram drafts get accepted and output stays exact."""
    target = tiny_model("llama", seed=5)
    ref = reference_copy(target)
    runner = make_runner(target, "ngram", "llama", max_num_seqs=2)
    prompt = [5, 6, 7, 8] * 3
    want = greedy_reference(ref, prompt, 40)
    r = Req("a", prompt, 40, k=K)
    assert run(runner, [r])["a"] == want
    assert r.verified > 0


def test_draft_model_equal_to_target_accepts_everything() -> None:
    """With the target as its own draft every greedy draft is accepted."""
    target = tiny_model("qwen2", seed=3)
    ref = reference_copy(target)
    draft = tiny_model("qwen2", seed=3)
    runner = ModelRunner(
        ModelExecutor(target, max_num_seqs=2, max_model_len=MAX_LEN),
        DraftModelDrafter(
            ModelExecutor(draft, max_num_seqs=2, max_model_len=MAX_LEN), max_num_tokens=K
        ),
        max_num_seqs=2,
        max_model_len=MAX_LEN,
        max_num_draft_tokens=K,
    )
    r = Req("a", [9, 10, 11], 21, k=K)
    assert run(runner, [r])["a"] == greedy_reference(ref, [9, 10, 11], 21)
    assert r.verified > 0 and r.accepted == r.verified


@pytest.mark.parametrize("mode", ["pad", "pad-fp32"])
def test_batch_invariant_padding_stays_lossless(mode: str) -> None:
    """The padded layout (GPU default) computes the same function: pads never leak into requests."""
    target = tiny_model("llama", seed=77)
    ref = reference_copy(target)
    runner = make_runner(target, "ngram", "llama", max_num_seqs=4, batch_invariant=mode)
    reqs = [
        Req(f"r{i}", p, 14, k=3, arrive=i, chunk=4 if i == 1 else 0)
        for i, p in enumerate(prompts(3, 77))
    ]
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id


@pytest.mark.long  # ~15 s of compiling on 2 cores; the GPU stage runs the compiled path too
def test_compiled_layers_stay_lossless() -> None:
    """``--enable-torch-compile``: the compiled decoder layers (inductor's C++ kernels here, Triton
    on GPU) with n-gram drafts, requests joining and leaving, chunked prefill: every output equals
    HF's eager greedy output, and the layers really ran compiled."""
    import torch._dynamo

    target = tiny_model("llama", seed=21)
    ref = reference_copy(target)
    runner = make_runner(target, "ngram", "llama", max_num_seqs=4, compile_layers=True)
    reqs = [
        Req(f"r{i}", p, 16, k=K, arrive=i, chunk=4 if i == 1 else 0)
        for i, p in enumerate(prompts(3, 21))
    ]
    torch._dynamo.utils.counters.clear()
    got = run(runner, reqs)
    for r in reqs:
        assert got[r.req_id] == greedy_reference(ref, r.prompt, r.max_tokens), r.req_id
    assert sum(r.verified for r in reqs) > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing was compiled"


@pytest.mark.parametrize("drafter_kind", ["none", "ngram", "draft_model"])
def test_seeded_sampling_is_reproducible_through_the_runner(drafter_kind: str) -> None:
    """Sampled verification end to end (draft distributions included): a seed fixes the output,
    and different seeds differ."""
    from protocol.messages import SamplingParams

    outs = []
    for seed in (5, 5, 6):
        target = tiny_model("llama", seed=13)
        runner = make_runner(target, drafter_kind, "llama", max_num_seqs=2)
        sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed)
        r = Req("s", [7, 8, 9, 7, 8, 9, 7], 24, k=K, sampling=sp)
        outs.append(run(runner, [r])["s"])
        assert all(0 <= t < VOCAB for t in outs[-1])
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_seeded_output_does_not_depend_on_batch_neighbours() -> None:
    from protocol.messages import SamplingParams

    sp = SamplingParams(temperature=1.0, seed=11)
    alone = run(
        make_runner(tiny_model("llama", seed=13), "ngram", "llama", max_num_seqs=3),
        [Req("s", [7, 8, 9, 7, 8, 9], 20, k=1, sampling=sp)],
    )["s"]
    crowd = run(
        make_runner(tiny_model("llama", seed=13), "ngram", "llama", max_num_seqs=3),
        [
            Req("s", [7, 8, 9, 7, 8, 9], 20, k=1, sampling=sp),
            Req("n", [5, 6, 5, 6, 5, 6, 5], 20, k=K),
        ],
    )["s"]
    assert alone == crowd


def test_a_refused_step_leaves_nothing_behind() -> None:
    """Bad bitmask layouts are refused before the forward, and the step's new requests leave."""
    import numpy as np

    from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
    from worker.runner import StepError

    runner = make_runner(tiny_model("llama", seed=3), "none", "llama", max_num_seqs=2)
    words = (VOCAB + 31) // 32

    def step(cu: list[int] | None, mask_rows: int, width: int = words) -> SchedulerOutput:
        return SchedulerOutput(
            step_id=1,
            req_ids=["a", "b"],
            new_requests=[
                NewRequest(r, np.array([5, 6, 7], np.int32), SamplingParams(), 0, True)
                for r in ("a", "b")
            ],
            num_scheduled_tokens=np.array([3, 3], np.int32),
            num_draft_tokens=np.zeros(2, np.int32),
            draft_token_ids=np.zeros(0, np.int32),
            finished_req_ids=[],
            aborted_req_ids=[],
            structured_req_ids=["a"],
            cu_bitmask_rows=None if cu is None else np.array(cu, np.int32),
            grammar_bitmask=np.full((mask_rows, width), -1, np.int32) if mask_rows else None,
        )

    for bad, code in [
        (step([0, 2], 2), "width_mismatch"),
        (step([0, 0], 1), "width_mismatch"),  # fewer rows than positions, too
        (step([0, 5], 1), "bad_step"),
        (step([0, 1], 0), "bad_step"),
        (step([0, 1], 1, width=1), "bad_step"),
        (step(None, 1), "bad_step"),
    ]:
        with pytest.raises(StepError) as info:
            runner.execute(bad)
        assert info.value.code == code
        assert not runner.states.slot_of, "a refused step must not keep its new requests"
    out, _ = runner.execute(step([0, 1], 1))
    assert out.num_sampled.tolist() == [1, 1]


def test_padded_decode_layout_matches_the_ragged_forward() -> None:
    """The same decode step (widths 1, 3 and 5; different histories) through the padded layout
    and through the ragged path: same logits (float32, CPU)."""
    torch.manual_seed(3)
    model = tiny_model("llama", seed=3)
    ex = ModelExecutor(model, max_num_seqs=4, max_model_len=MAX_LEN, decode_width=5)
    prompts_ = [list(range(3, 3 + n)) for n in (7, 11, 4)]
    slots = [2, 0, 3]
    for slot, p in zip(slots, prompts_, strict=True):  # prefill each (ragged: longer than 5)
        ids = torch.tensor(p + [1] * 3)
        ex.forward(ids, torch.arange(len(ids)), [slot], [0], [len(ids)], torch.tensor([0]))
    widths = [1, 3, 5]
    starts = [len(p) for p in prompts_]
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13])
    positions = torch.tensor([s + j for s, w in zip(starts, widths, strict=True) for j in range(w)])
    rows = torch.arange(9)
    assert ex.decode.fits(widths, starts)
    n0 = ex.decode.num_forwards
    dense, _ = ex.forward(ids, positions, slots, starts, widths, rows)
    assert ex.decode.num_forwards == n0 + 1
    ex.decode.width = 1  # the same step must now take the ragged path
    assert not ex.decode.fits(widths, starts)
    ragged, _ = ex.forward(ids, positions, slots, starts, widths, rows)
    torch.testing.assert_close(dense, ragged, rtol=1e-5, atol=1e-5)
