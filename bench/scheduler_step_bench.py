"""The scheduler's bookkeeping per step, without a worker: ``schedule`` + ``update`` +
``take_drafts`` (with detokenization) for B running requests, each step committing 2 tokens and
taking 4 draft placeholders. Used for the figure in docs/performance.md (overlap section).

    python bench/scheduler_step_bench.py
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from protocol.messages import DraftTokenIds, ModelRunnerOutput, SamplingParams
from scheduler_client.request import Request
from scheduler_client.scheduler import Scheduler, SchedulerConfig, WorkerLimits
from scheduler_client.tokenizer import TokenizerInfo
from worker.model_loader import resolve_model_dir

_, d = resolve_model_dir("embedded:smollm2")
tok = TokenizerInfo(d)
B = 64
lim = WorkerLimits(
    vocab_size=49152,
    eos_token_ids=(2,),
    max_model_len=2048,
    max_num_speculative_tokens=4,
    max_num_seqs=B,
)
s = Scheduler(SchedulerConfig(max_num_seqs=B, max_num_batched_tokens=8192), lim, tok, None)
rng = np.random.default_rng(0)
for i in range(B):
    s.add(
        Request(
            f"r{i}",
            rng.integers(100, 40000, 100).tolist(),  # Python ints: the scheduler checks types
            SamplingParams(max_tokens=1900),
            4,
            detok=None,
        )
    )
    assert s.requests[f"r{i}"].error is None, s.requests[f"r{i}"].error


def step():
    out = s.schedule()
    ids = out.req_ids
    n = np.full(len(ids), 2, np.int32)
    toks = rng.integers(100, 40000, 2 * len(ids)).astype(np.int32)
    w = out.num_draft_tokens
    s.update(
        ModelRunnerOutput(
            step_id=out.step_id,
            req_ids=ids,
            num_sampled=n,
            sampled_token_ids=toks,
            num_draft_tokens=w,
            num_accepted=np.minimum(w, 1).astype(np.int32),
        )
    )
    s.take_drafts(
        DraftTokenIds(
            step_id=out.step_id,
            req_ids=ids,
            num_draft_tokens=np.full(len(ids), 4, np.int32),
            draft_token_ids=np.full(4 * len(ids), 7, np.int32),
            num_committed_tokens=np.array([s.requests[r].num_tokens for r in ids], np.int32),
        )
    )


step()
t0 = time.perf_counter()
N = 200
for _ in range(N):
    step()
print(f"per step (batch {B}): {(time.perf_counter() - t0) / N * 1e3:.2f} ms")

# The tuner's two decisions a step (choose, then propose) at batch 1, 8 and 64: five measured
# widths, random per-request histories and hit rates
from scheduler_client.spec_tuner import SpeculationTuner  # noqa: E402

for b in (1, 8, B):
    tuner = SpeculationTuner(4)
    for w in range(1, 6):
        tuner.observe_step(b, w, 0.0075 + 0.0006 * w)
    alphas = [tuner.alpha(int(rng.integers(0, 200)), int(rng.integers(0, 100))) for _ in range(b)]
    hits = rng.random(b).tolist()
    t0 = time.perf_counter()
    for _ in range(2000):
        tuner.choose(alphas, [4] * b, hits)
        tuner.propose(alphas, [4] * b, hits)
    dt = (time.perf_counter() - t0) / 2000
    print(f"SpeculationTuner.choose + propose (batch {b}): {dt * 1e6:.1f} us")

# A chat request's prompt: the model's chat template rendered (at admission, once a request)
messages = [{"role": "user", "content": "Extract the person as JSON: Maria Lopez is 34."}]
tok.apply_chat_template(messages)
t0 = time.perf_counter()
for _ in range(200):
    tok.apply_chat_template(messages)
print(f"TokenizerInfo.apply_chat_template: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms")
