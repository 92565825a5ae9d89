"""A randomized fuzz of --chain-drafts: valid overlap schedules (arrivals, prefill chunks, finishes,
aborts and re-adds while a chained step is open, caps and the tuner's proposals varying, stop ids,
sampled, structured and scheduler-supplied drafts among them, contexts near their end) run with
chain=True and chain=False (both pipelined, tests/test_chain_drafts.py's ``Chained`` driver),
compared step by step (outputs, drafts verified, refusals), at drain checkpoints (the host's
state), at the end (every KV block free), and against target-only greedy.

    python -m tests.chain_fuzz SEED_START NUM_SEEDS [--verbose]    # make fuzz-chain: 600 seeds

``make test`` runs a sample (tests/test_chain_drafts.py).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.messages import NewRequest, SamplingParams, SchedulerOutput
from tests.models import greedy_reference, reference_copy, tiny_model
from tests.test_chain_drafts import Chained
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.runner import ModelRunner
from worker.step_batch import StepError

K = 4
EOS = 2
VOCAB = 128

# ------------------------------------------------------------------ models & references
_models: dict[int, torch.nn.Module] = {}
_refs: dict[tuple[int, tuple[int, ...]], list[int]] = {}


def ref_model(seed: int) -> torch.nn.Module:
    if seed not in _models:
        _models[seed] = reference_copy(tiny_model("llama", seed)).eval()
    return _models[seed]


def greedy(seed: int, prompt: list[int], n: int) -> list[int]:
    key = (seed, tuple(prompt))
    have = _refs.get(key, [])
    if len(have) < n:
        have = greedy_reference(ref_model(seed), list(prompt), n)
        _refs[key] = have
    return have[:n]


def make_runner(cfg: dict, chain: bool) -> ModelRunner:
    target = tiny_model("llama", cfg["model_seed"])
    return ModelRunner(
        ModelExecutor(
            target,
            max_num_seqs=cfg["max_num_seqs"],
            max_model_len=cfg["L"],
            decode_width=1 + K,
            cuda_graphs=True,
            kv_block_size=cfg["block_size"],
        ),
        NgramDrafter(min_n=cfg["min_n"], max_n=cfg["max_n"], max_num_tokens=K),
        max_num_seqs=cfg["max_num_seqs"],
        max_model_len=cfg["L"],
        max_num_draft_tokens=K,
        chain_drafts=chain,
    )


# ------------------------------------------------------------------ request plan
@dataclass
class Spec:
    name: str
    arrive: int
    prompt: list[int]
    kind: str  # greedy | sampled | structured
    nst: int
    max_tokens: int
    stop: tuple[int, ...]
    ignore_eos: bool
    temperature: float = 0.0
    seed: int | None = None
    top_k: int = 0
    abort_at: int = -1
    finish_at: int = -1  # the scheduler lets it go early (a stop string)
    preempt_at: int = -1  # abort and re-add with prompt + outputs
    readd_same_step: bool = False
    chunk: bool = False


def make_plan(seed: int) -> tuple[dict, list[Spec]]:
    rng = np.random.default_rng(seed)
    L = int(rng.choice([48, 64, 64, 64]))
    cfg = dict(
        seed=seed,
        model_seed=int(rng.choice([5, 11, 21])),
        L=L,
        max_num_seqs=int(rng.integers(1, 5)),
        block_size=int(rng.choice([4, 8, 16])),
        min_n=int(rng.choice([1, 1, 2])),
        max_n=0,
        adv_room=bool(rng.random() < 0.5),  # worst-case room bound (one tighter than scheduler)
        p_skip=float(rng.choice([0.0, 0.05])),
        p_checkpoint=float(rng.choice([0.0, 0.05, 0.15])),
        p_realids=float(rng.choice([0.0, 0.03, 0.08])),
        cap_mode=str(rng.choice(["fixed-1", "random", "streaky", "tuner"])),
    )
    cfg["max_n"] = int(rng.integers(cfg["min_n"], 4))
    n_req = int(rng.integers(2, 9))
    specs: list[Spec] = []
    t = 0
    for i in range(n_req):
        t += int(rng.integers(0, 8))
        shape = rng.choice(["rep", "rep", "rand", "long", "short"])
        if shape == "rep":
            p = int(rng.integers(1, 6))
            pat = rng.integers(3, VOCAB, p)
            n = int(rng.integers(4, 26))
            prompt = np.resize(pat, n)
            if rng.random() < 0.3:
                j = int(rng.integers(0, n))
                prompt[j] = int(rng.integers(0, VOCAB))
        elif shape == "rand":
            prompt = rng.integers(0, VOCAB, int(rng.integers(2, 24)))
        elif shape == "short":
            prompt = rng.integers(0, VOCAB, int(rng.integers(1, 3)))
        else:
            n = L - int(rng.integers(1, 16))
            if rng.random() < 0.6:
                prompt = np.resize(rng.integers(3, VOCAB, int(rng.integers(1, 6))), n)
            else:
                prompt = rng.integers(0, VOCAB, n)
        prompt = [int(x) for x in prompt]
        kind = str(rng.choice(["greedy"] * 7 + ["sampled", "structured"]))
        mt = int(rng.choice([1, 2, 3, 5, 8, 13, 20, 40, 1000]))
        ref = greedy(cfg["model_seed"], prompt, min(L - len(prompt), 60))
        stop: tuple[int, ...] = ()
        if rng.random() < 0.25 and ref:
            stop = (int(ref[int(rng.integers(0, len(ref)))]),)
        s = Spec(
            name=f"r{i}",
            arrive=t,
            prompt=prompt,
            kind=kind,
            nst=int(rng.integers(0, K + 1)) if rng.random() < 0.8 else K,
            max_tokens=mt,
            stop=stop,
            ignore_eos=bool(rng.random() < 0.5),
            chunk=bool(rng.random() < 0.25),
        )
        if kind == "sampled":
            s.temperature = float(rng.uniform(0.5, 1.2))
            s.seed = int(rng.integers(0, 1000))
            s.top_k = int(rng.choice([0, 0, 5]))
        u = rng.random()
        if u < 0.12:
            s.abort_at = t + int(rng.integers(1, 30))
        elif u < 0.24:
            s.finish_at = t + int(rng.integers(1, 30))
        elif u < 0.4:
            s.preempt_at = t + int(rng.integers(2, 30))
            s.readd_same_step = bool(rng.random() < 0.4)
        specs.append(s)
    return cfg, specs


# ------------------------------------------------------------------ scheduler model
@dataclass
class RS:
    spec: Spec
    status: str = "waiting"  # waiting | running | done | gone
    inc: int = 0
    readd_at: int = -1
    computed: int = 0
    outputs: list[int] = field(default_factory=list)  # scheduler view, all incarnations
    inc_prompt: list[int] = field(default_factory=list)
    inflight: dict[int, tuple[int, int, bool]] = field(
        default_factory=dict
    )  # step -> m, w, samples
    reason: str = ""
    done_outputs: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt) + len(self.outputs)


class Sched:
    def __init__(self, cfg: dict, specs: list[Spec]) -> None:
        self.cfg = cfg
        self.L = cfg["L"]
        self.reqs = {s.name: RS(s) for s in specs}
        self.step_id = 0
        self.to_free: list[str] = []
        self.to_abort: list[str] = []
        self.incs: dict[int, dict[str, int]] = {}  # step -> req -> incarnation
        self.cap = -1
        self.words = (VOCAB + 31) // 32

    def rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.cfg["seed"], 7919, *key])

    def all_done(self) -> bool:
        return all(r.status in ("done", "gone") for r in self.reqs.values()) and not (
            self.to_free or self.to_abort
        )

    def _finish(self, r: RS, why: str, free: bool = True) -> None:
        r.status = "done"
        r.reason = why
        r.done_outputs = list(r.outputs)
        r.inflight.clear()
        if free:
            self.to_free.append(r.spec.name)

    def build(self, clock: int) -> SchedulerOutput | None:
        n = clock  # plan decisions follow the clock; the message carries self.step_id
        sid_ = self.step_id
        g = self.rng(n)
        cfg = self.cfg
        # proposals cap for this step
        mode = cfg["cap_mode"]
        if mode == "fixed-1":
            cap = -1
        elif mode == "random":
            cap = int(g.choice([-1, 0, 1, 2, 4]))
        elif mode == "streaky":
            cap = self.cap if g.random() < 0.7 else int(g.choice([-1, 0, 1, 2, 4]))
        else:  # the tuner re-measuring a drafter it turned down: 0 mostly, K every few
            cap = K if n % 4 == 2 else 0
        self.cap = cap
        # planned departures
        new_reqs: list[NewRequest] = []
        for r in self.reqs.values():
            s = r.spec
            if r.status != "running":
                continue
            if s.abort_at == n:
                self._finish(r, "abort", free=False)
                self.to_abort.append(s.name)
            elif s.finish_at == n:
                self._finish(r, "early")
            elif s.preempt_at == n:
                self.to_abort.append(s.name)
                r.status = "waiting"
                r.inc += 1
                r.inflight.clear()
                r.computed = 0
                r.readd_at = n if s.readd_same_step else n + int(g.integers(1, 4))
        gone = set(self.to_free) | set(self.to_abort)
        ids: list[str] = []
        counts: list[int] = []
        widths: list[int] = []
        drafts: list[np.ndarray] = []
        structured: list[tuple[str, int]] = []
        incs: dict[str, int] = {}
        samples_of: dict[str, bool] = {}
        L = self.L
        for name, r in self.reqs.items():
            if r.status != "running":
                continue
            s = r.spec
            h = self.rng(n, int(name[1:]), r.inc)
            if h.random() < cfg["p_skip"]:
                continue
            inflight_m = sum(m for m, _, _ in r.inflight.values())
            pending = [w for m, w, smp in r.inflight.values() if smp]
            uncomputed = r.num_tokens - r.computed - inflight_m
            real = h.random() < cfg["p_realids"]
            if pending:
                w_n = pending[-1]
                if len(r.outputs) + len(pending) >= s.max_tokens:
                    continue
                room = L - (r.num_tokens + 1 + w_n) - (0 if cfg["adv_room"] else 1)
                if room < 0:
                    continue
                m = 1
            elif uncomputed == 1:
                m = 1
                room = L - r.num_tokens
            elif uncomputed > 1:
                m = uncomputed
                if s.chunk and h.random() < 0.5:
                    m = int(h.integers(1, uncomputed))
                ids.append(name)
                counts.append(m)
                widths.append(0)
                drafts.append(np.zeros(0, np.int32))
                incs[name] = r.inc
                samples_of[name] = m == uncomputed
                r.inflight[sid_] = (m, 0, m == uncomputed)
                if m == uncomputed and s.kind == "structured":
                    structured.append((name, 1))
                continue
            else:
                continue
            w = int(h.integers(0, min(K, room) + 1))
            if h.random() < 0.5:
                w = min(K, room)  # the usual: the widest cap
            if s.kind == "structured" and not real:
                w = 0 if h.random() < 0.7 else w
                real = w > 0
            if real and w:
                # scheduler-supplied ids: random, or the greedy continuation (accepted)
                if h.random() < 0.5:
                    guess = greedy(cfg["model_seed"], s.prompt, L - len(s.prompt) + K)[
                        len(r.outputs) + len(pending) :
                    ]
                    ids_ = np.array((guess + [5] * K)[:w], np.int32)
                else:
                    ids_ = h.integers(0, VOCAB, w).astype(np.int32)
                if h.random() < 0.2 and s.kind != "structured":
                    p = int(h.integers(1, w + 1))
                    ids_[:p] = -1  # placeholders then real ids: may be refused (width_mismatch)
            else:
                ids_ = np.full(w, -1, np.int32)
            ids.append(name)
            counts.append(m + w)
            widths.append(w)
            drafts.append(ids_)
            incs[name] = r.inc
            samples_of[name] = True
            r.inflight[sid_] = (m, w, True)
            if s.kind == "structured":
                structured.append((name, w + 1))
        # arrivals (and re-adds)
        running = sum(1 for r in self.reqs.values() if r.status == "running")
        for name, r in self.reqs.items():
            s = r.spec
            if r.status != "waiting":
                continue
            due = s.arrive <= n if r.inc == 0 else r.readd_at <= n
            if not due:
                continue
            # every running request holds a slot; those let go this step free theirs now
            if running >= cfg["max_num_seqs"]:
                continue
            if len(s.prompt) + len(r.outputs) >= L:
                self._finish(r, "length", free=False)
                continue
            prompt = s.prompt + r.outputs
            r.inc_prompt = prompt
            r.status = "running"
            r.computed = 0
            running += 1
            h = self.rng(n, int(name[1:]), r.inc, 1)
            m = len(prompt)
            if s.chunk and m > 1 and h.random() < 0.6:
                m = int(h.integers(1, m))
            new_reqs.append(
                NewRequest(
                    name,
                    np.array(prompt, np.int32),
                    SamplingParams(
                        temperature=s.temperature,
                        top_k=s.top_k,
                        seed=s.seed,
                        max_tokens=s.max_tokens,
                        stop_token_ids=s.stop,
                    ),
                    s.nst,
                    structured=s.kind == "structured",
                )
            )
            ids.append(name)
            counts.append(m)
            widths.append(0)
            drafts.append(np.zeros(0, np.int32))
            incs[name] = r.inc
            samples_of[name] = m == len(prompt)
            r.inflight[sid_] = (m, 0, m == len(prompt))
            if m == len(prompt) and s.kind == "structured":
                structured.append((name, 1))
        if not ids and not self.to_free and not self.to_abort:
            return None
        sid = [q for q, _ in structured]
        cu = np.concatenate([[0], np.cumsum([k for _, k in structured])]).astype(np.int32)
        bitmask = np.full((int(cu[-1]), self.words), -1, np.int32) if structured else None
        out = SchedulerOutput(
            step_id=sid_,
            new_requests=new_reqs,
            req_ids=ids,
            num_scheduled_tokens=np.array(counts, np.int32),
            num_draft_tokens=np.array(widths, np.int32),
            draft_token_ids=np.concatenate(drafts).astype(np.int32)
            if drafts
            else np.zeros(0, np.int32),
            finished_req_ids=list(self.to_free),
            aborted_req_ids=list(self.to_abort),
            structured_req_ids=sid,
            cu_bitmask_rows=cu if structured else None,
            grammar_bitmask=bitmask,
            draft_widths_are_caps=True,
            max_draft_proposals=cap,
        )
        for q in gone:
            if self.reqs[q].status == "done":
                self.reqs[q].status = "gone"
        self.to_free, self.to_abort = [], []
        self.incs[sid_] = incs
        self.step_id += 1
        return out

    def refused(self, s: SchedulerOutput, clock: int) -> None:
        n = s.step_id
        for nr in s.new_requests:
            r = self.reqs[nr.req_id]
            r.inflight.pop(n, None)
            if r.status == "running":
                r.status = "waiting"
                r.readd_at = clock + 1
                r.computed = 0
        for q in s.req_ids:
            self.reqs[q].inflight.pop(n, None)

    def settle(self, step_id: int, out) -> None:  # type: ignore[no-untyped-def]
        incs = self.incs.get(step_id, {})
        flat = out.sampled_token_ids.tolist()
        off = 0
        for i, q in enumerate(out.req_ids):
            ns = int(out.num_sampled[i])
            toks = flat[off : off + ns]
            off += ns
            r = self.reqs[q]
            if r.status != "running" or incs.get(q) != r.inc or step_id not in r.inflight:
                continue
            m, _w, _smp = r.inflight.pop(step_id)
            acc = int(out.num_accepted[i])
            r.computed += m + (acc if ns else 0)
            if not ns:
                continue
            s = r.spec
            for t in toks:
                if t in s.stop or (t == EOS and not s.ignore_eos):
                    self._finish(r, "stop")
                    break
                r.outputs.append(t)
                if len(r.outputs) >= s.max_tokens or r.num_tokens >= self.L:
                    self._finish(r, "length")
                    break


# ------------------------------------------------------------------ driver
class Probe(Chained):
    def __init__(self, r: ModelRunner) -> None:
        super().__init__(r)
        self.queue: list[tuple[int, object]] = []
        self.records: dict[int, dict] = {}
        self.problems: list[str] = []

    def step(self, s: SchedulerOutput) -> tuple[str, str] | None:  # type: ignore[override]
        try:
            super().step(s)
        except StepError as e:
            self.drain()  # as WorkerLoop.step: the open step is answered
            return (e.code, str(e))
        return None

    def take(self, launched) -> None:  # type: ignore[no-untyped-def]
        out, rejected = self.r.finish(launched)
        if rejected:
            self.problems.append(f"step {out.step_id}: rejected {[e.code for e in rejected]}")
        drafts = self.r.take_draft_tokens()
        rec = {}
        flat = out.sampled_token_ids.tolist()
        off = 0
        for i, q in enumerate(out.req_ids):
            ns = int(out.num_sampled[i])
            rec[q] = (
                flat[off : off + ns],
                int(out.num_draft_tokens[i]),
                int(out.num_accepted[i]),
            )
            off += ns
        msg = None
        if drafts is not None:
            msg = (
                list(drafts.req_ids),
                drafts.num_draft_tokens.tolist(),
                drafts.num_committed_tokens.tolist(),
            )
        self.records[out.step_id] = {"out": rec, "drafts": msg}
        self.queue.append((out.step_id, out))


def snapshot(r: ModelRunner) -> dict:
    st = r.states
    blocks = r.target.kv_cache.blocks
    snap = {"_free_blocks": blocks.num_free}
    for q, slot in st.slot_of.items():
        n = int(st.num_tokens[slot])
        nd = int(st.num_drafts[slot])
        snap[q] = dict(
            num_tokens=n,
            num_computed=int(st.num_computed[slot]),
            tokens=st.token_ids[slot, :n].tolist(),
            num_drafts=nd,
            drafts=st.draft_token_ids[slot, :nd].tolist(),
            held_blocks=int(blocks.num_held[slot]),
        )
    return snap


def sched_to_dict(s: SchedulerOutput) -> dict:
    return dict(
        step_id=s.step_id,
        new_requests=[
            dict(
                req_id=q.req_id,
                prompt=q.prompt_token_ids.tolist(),
                sampling=dict(
                    temperature=q.sampling.temperature,
                    top_k=q.sampling.top_k,
                    seed=q.sampling.seed,
                    max_tokens=q.sampling.max_tokens,
                    stop_token_ids=list(q.sampling.stop_token_ids),
                ),
                nst=q.num_speculative_tokens,
                structured=q.structured,
            )
            for q in s.new_requests
        ],
        req_ids=list(s.req_ids),
        counts=s.num_scheduled_tokens.tolist(),
        widths=s.num_draft_tokens.tolist(),
        drafts=s.draft_token_ids.tolist(),
        finished=list(s.finished_req_ids),
        aborted=list(s.aborted_req_ids),
        structured=list(s.structured_req_ids),
        cu=None if s.cu_bitmask_rows is None else s.cu_bitmask_rows.tolist(),
        cap=s.max_draft_proposals,
    )


# ------------------------------------------------------------------ one schedule
@dataclass
class Lane:
    chain: bool
    runner: ModelRunner
    drv: Probe
    sched: Sched
    steps: list[dict] = field(default_factory=list)
    refusals: dict[int, tuple[str, str]] = field(default_factory=dict)
    error: str | None = None


def run_schedule(seed: int, max_steps: int = 700) -> dict:
    cfg, specs = make_plan(seed)
    lanes = []
    for chain in (False, True):
        r = make_runner(cfg, chain)
        sc = Sched(cfg, [Spec(**s.__dict__) for s in specs])
        lanes.append(Lane(chain, r, Probe(r), sc))
    findings: list[str] = []
    sched_diverged_at = None
    state_checks = 0

    def safe_drain(lane: Lane) -> bool:
        try:
            lane.drv.drain()
            return True
        except Exception as e:
            lane.error = f"drain: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            return False

    def settle(lane: Lane, upto: int) -> None:
        keep = []
        for sid, out in sorted(lane.drv.queue, key=lambda x: x[0]):
            if sid <= upto:
                lane.sched.settle(sid, out)
            else:
                keep.append((sid, out))
        lane.drv.queue = keep

    for it in range(max_steps):
        if all(ln.error or ln.sched.all_done() for ln in lanes):
            break
        built = []
        for lane in lanes:
            if lane.error:
                built.append(None)
                continue
            s = lane.sched.build(it)
            if s is None and not lane.sched.all_done():
                # nothing to send until the outputs in flight arrive (or an arrival is due)
                if not safe_drain(lane):
                    built.append(None)
                    continue
                settle(lane, 10**9)
                s = lane.sched.build(it)
            built.append(s)
        if all(s is None for s in built):
            continue  # an idle tick
        d = [None if s is None else sched_to_dict(s) for s in built]
        if d[0] != d[1] and sched_diverged_at is None:
            sched_diverged_at = d[0]["step_id"] if d[0] else d[1]["step_id"]
            findings.append(f"schedule diverged at step {sched_diverged_at}")
        checkpoint = np.random.default_rng([seed, 31337, it]).random() < cfg["p_checkpoint"]
        for lane, s, dd in zip(lanes, built, d, strict=False):
            if s is None or lane.error:
                continue
            lane.steps.append(dd)
            try:
                err = lane.drv.step(s)
            except Exception as e:
                lane.error = f"step {s.step_id}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
                continue
            if err is not None:
                lane.refusals[s.step_id] = err
                lane.sched.refused(s, it)
            settle(lane, s.step_id - 1)
            if checkpoint:
                if not safe_drain(lane):
                    continue
                settle(lane, 10**9)
        if checkpoint and sched_diverged_at is None and not any(ln.error for ln in lanes):
            a, b = snapshot(lanes[0].runner), snapshot(lanes[1].runner)
            state_checks += 1
            if a != b:
                diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                findings.append(
                    f"state differs after drain at step {next(x for x in built if x).step_id}: {diff}"
                )
    for lane in lanes:
        if lane.error:
            findings.append(f"chain={lane.chain} raised: {lane.error}")
            continue
        if not safe_drain(lane):
            findings.append(f"chain={lane.chain} raised: {lane.error}")
            continue
        settle(lane, 10**9)
        # the end: every request finished, every block free
        if not lane.sched.all_done():
            findings.append(f"chain={lane.chain}: not all requests finished in {max_steps} steps")
        else:
            st = lane.runner.states
            blocks = lane.runner.target.kv_cache.blocks
            if st.slot_of or blocks.num_free != blocks.num_blocks:
                findings.append(
                    f"chain={lane.chain}: at the end slot_of={dict(st.slot_of)} free "
                    f"{blocks.num_free}/{blocks.num_blocks}"
                )
        for p in lane.drv.problems:
            findings.append(f"chain={lane.chain}: {p}")
    a, b = lanes
    # refusals
    if a.refusals != b.refusals and not (a.error or b.error):
        ks = sorted(set(a.refusals) | set(b.refusals))
        findings.append(
            "refusals differ: "
            + "; ".join(
                f"{k}: closed={a.refusals.get(k)} chain={b.refusals.get(k)}"
                for k in ks
                if a.refusals.get(k) != b.refusals.get(k)
            )
        )
    # per-step outputs while the schedules agree
    first_out_diff = None
    if not (a.error or b.error):
        for sid in sorted(set(a.drv.records) | set(b.drv.records)):
            if sched_diverged_at is not None and sid >= sched_diverged_at:
                break
            ra, rb = a.drv.records.get(sid), b.drv.records.get(sid)
            if ra is None or rb is None or ra["out"] != rb["out"]:
                first_out_diff = (sid, ra and ra["out"], rb and rb["out"])
                findings.append(
                    f"step {sid} output differs: closed={first_out_diff[1]} chain={first_out_diff[2]}"
                )
                break
    # scheduler-view outputs against greedy / each other
    for name in a.sched.reqs:
        ra, rb = a.sched.reqs[name], b.sched.reqs[name]
        s = ra.spec
        for lane, rr in ((a, ra), (b, rb)):
            if lane.error:
                continue
            if s.kind in ("greedy", "structured"):
                want = greedy(cfg["model_seed"], s.prompt, min(len(rr.outputs) + 1, cfg["L"]))
                if rr.outputs != want[: len(rr.outputs)]:
                    findings.append(
                        f"chain={lane.chain} {name}: output {rr.outputs} is not greedy {want}"
                    )
                elif rr.reason in ("stop", "length"):
                    full = greedy(cfg["model_seed"], s.prompt, cfg["L"] - len(s.prompt))
                    exp = []
                    for t in full:
                        if t in s.stop or (t == EOS and not s.ignore_eos):
                            break
                        exp.append(t)
                        if len(exp) >= s.max_tokens:
                            break
                    if rr.outputs != exp:
                        findings.append(
                            f"chain={lane.chain} {name}: finished ({rr.reason}) with {rr.outputs}, "
                            f"expected {exp}"
                        )
        if (
            not (a.error or b.error)
            and s.abort_at < 0
            and s.finish_at < 0
            and s.preempt_at < 0
            and ra.outputs != rb.outputs
        ):
            findings.append(f"{name} ({s.kind}): closed {ra.outputs} != chain {rb.outputs}")
    stats = dict(
        steps=len(b.steps),
        chained=b.drv.chained,
        closed_first=b.drv.closed_first,
        pipelined=b.drv.pipelined,
        refusals=len(b.refusals),
        state_checks=state_checks,
        verified=sum(v[1] for rec in b.drv.records.values() for v in rec["out"].values()),
    )
    return dict(
        seed=seed,
        cfg=cfg,
        findings=findings,
        stats=stats,
        steps_closed=a.steps,
        steps_chain=b.steps,
    )


def main() -> None:
    torch.set_num_threads(1)
    start, num = int(sys.argv[1]), int(sys.argv[2])
    verbose = "--verbose" in sys.argv
    tot = dict(
        schedules=0,
        steps=0,
        chained=0,
        closed_first=0,
        refusals=0,
        state_checks=0,
        verified=0,
        failing=0,
    )
    t0 = time.time()
    fails = []
    for seed in range(start, start + num):
        res = run_schedule(seed)
        tot["schedules"] += 1
        for k in ("steps", "chained", "closed_first", "refusals", "state_checks", "verified"):
            tot[k] += res["stats"][k]
        if res["findings"]:
            tot["failing"] += 1
            fails.append(res)
            print(
                f"seed {seed}: {len(res['findings'])} findings; first: {res['findings'][0][:400]}"
            )
            if verbose:
                for f in res["findings"]:
                    print("   ", f[:1500])
    print(json.dumps(tot), f"{time.time() - t0:.1f}s")
    if tot["failing"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
