"""``make mutants``: plant each bug of a fixed list in a copy of the tree and run the tests that
should catch it; report which bugs the suite catches and which survive.

Each mutant replaces one exact snippet (``old``, which must occur exactly once, so the list stays
true when the code moves: a snippet that no longer matches fails the run loudly) in a fresh copy of
the tree (``git ls-files`` plus untracked files git does not ignore), under a temporary folder that
is removed afterwards, also on Ctrl-C. The real tree is never written. The tests run in the copy
with this Python, ``PYTHONPATH`` pointing at the copy (so launched workers import the mutant too).

Outcomes: ``caught`` (a test failed), ``survived`` (the selection passed: the suite misses this
bug), ``error`` (the harness could not judge: no tests collected, a usage error, a timeout). The
mutants run one after another (the tests start processes of their own); the run exits 1 when any
mutant survives or errs, 2 when the unmutated copy already fails its tests.

By default each mutant runs a targeted selection (the tests most likely to catch it first, then a
shared core of fast CPU tests; ``-x`` stops at the first failure); ``--full`` runs ``make test``'s
whole suite for each mutant instead. Globs that match nothing are skipped, so the selection picks
up test files added later under those names.

    python tools/mutants.py                 # all mutants, targeted
    python tools/mutants.py --list          # the list, nothing run
    python tools/mutants.py --only residual-position --only stale-length
    python tools/mutants.py --full          # each mutant against the whole suite
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Fast in-process tests every targeted selection ends with (globs: later files join by name).
CORE = (
    "tests/test_rejection*.py",
    "tests/test_sampl*.py",
    "tests/test_oracle.py",
    "tests/test_*accept*.py",
    "tests/test_stale*.py",
    "tests/test_struct*.py",
    "tests/test_scheduler_unit.py",
    "tests/test_deferred_rows.py",
    "tests/test_draft_tokens.py",
    "tests/test_spec_tuner.py",
    "tests/test_worker_lossless.py",
)
E2E = "tests/test_scheduler_e2e.py::"
VERIFY = ("tests/test_rejection*.py", "tests/test_sampl*.py", "tests/test_oracle.py")
STALE = ("tests/test_stale*.py", E2E + "test_stale_drafts_are_dropped_and_output_stays_constrained")
ROWS = ("tests/test_struct*.py", "tests/test_deferred_rows.py")
GRAMMAR_E2E = (
    E2E + "test_forbidden_drafts_are_dropped",
    E2E + "test_json_schema_outputs_validate[ngram-nested-enum-int]",
)
OVERLAP = ("tests/test_overlap.py::test_overlap_structured_greedy_equals_sync_and_validates",)
REPLAY = (E2E + "test_kill_9_mid_run_restarts_the_worker_and_replays_identically",)


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in path
    new: str
    what: str  # the bug, in one line
    tests: tuple[str, ...] = ()  # pytest args tried first (globs or node ids), before CORE


MUTANTS: tuple[Mutant, ...] = (
    # -- the rejection sampler (worker/rejection.py) --------------------------------------------
    Mutant(
        "residual-position",
        "worker/rejection.py",
        "at.clamp(max=max(k - 1, 0))",
        "(at - 1).clamp(min=0)",
        "the residual max(0, p - q) takes q from the position before the rejected one",
        VERIFY,
    ),
    Mutant(
        "accept-without-q",
        "worker/rejection.py",
        "inp.uniforms[:, :k] * q_d < p_d",
        "inp.uniforms[:, :k] < p_d",
        "a draft is accepted with probability p(d), not min(1, p(d) / q(d))",
        VERIFY,
    ),
    Mutant(
        "bonus-draw",
        "worker/rejection.py",
        "inp.uniforms.gather(1, num_drafts[:, None]).squeeze(1)",
        "inp.uniforms[:, 0]",
        "the final token uses draw 0 (the first draft's) instead of draw num_drafts",
        VERIFY,
    ),
    Mutant(
        "bonus-from-residual",
        "worker/rejection.py",
        "residual = torch.where(all_accepted[:, None], p_at, (p_at - q_at).clamp(min=0))",
        "residual = (p_at - q_at).clamp(min=0)",
        "with every draft accepted, the bonus token is drawn from max(0, p - q), not from p",
        VERIFY,
    ),
    Mutant(
        "greedy-prefix",
        "worker/rejection.py",
        "greedy_match.int().cumprod(-1).sum(-1)",
        "greedy_match.int().sum(-1)",
        "verify counts every matching greedy draft, not the matching prefix",
        VERIFY,
    ),
    Mutant(
        "sampled-prefix",
        "worker/rejection.py",
        "accept.int().cumprod(-1).sum(-1)",
        "accept.int().sum(-1)",
        "verify counts every accepted sampled draft, not the accepted prefix",
        VERIFY,
    ),
    Mutant(
        "greedy-fast-path-prefix",
        "worker/rejection.py",
        "n = w if match.all() else int(match.argmin())",
        "n = int(match.sum())",
        "verify_greedy counts every matching draft, not the matching prefix",
        ("tests/test_rejection*.py", "tests/test_worker_lossless.py"),
    ),
    # -- distributions (worker/sampling.py) -----------------------------------------------------
    Mutant(
        "temperature-twice",
        "worker/sampling.py",
        "logits = logits / temperature[:, None]",
        "logits = logits / temperature[:, None] / temperature[:, None]",
        "the temperature divides the logits twice",
        VERIFY,
    ),
    Mutant(
        "top-p-off-by-one",
        "worker/sampling.py",
        "mass_before = probs_sorted.cumsum(-1) - probs_sorted",
        "mass_before = probs_sorted.cumsum(-1)",
        "top-p drops the token whose mass reaches p (and can drop every token)",
        VERIFY,
    ),
    Mutant(
        "top-k-off-by-one",
        "worker/sampling.py",
        "drop = rank >= k",
        "drop = rank > k",
        "top-k keeps k + 1 tokens",
        VERIFY,
    ),
    # -- stale drafts (scheduler_client/scheduler.py) -------------------------------------------
    Mutant(
        "stale-length",
        "scheduler_client/scheduler.py",
        "if waiting or stale_step or int(msg.num_committed_tokens[i]) != req.num_tokens:",
        "if waiting or stale_step:",
        "drafts proposed for another committed length are used",
        STALE,
    ),
    Mutant(
        "stale-step",
        "scheduler_client/scheduler.py",
        "stale_step = msg.step_id != self.last_done_step",
        "stale_step = False",
        "drafts of an older step are used",
        STALE,
    ),
    # -- grammar bitmask rows -------------------------------------------------------------------
    Mutant(
        "rows-first-only",
        "worker/grammar_rows.py",
        "mask_rows.extend(range(int(cu[k]), int(cu[k + 1])))",
        "mask_rows.extend([int(cu[k])] * have)",
        "every position of a structured request gets its first row (the mask before any draft)",
        (*ROWS, *GRAMMAR_E2E),
    ),
    Mutant(
        "rows-offset",
        "worker/grammar_rows.py",
        "mask_rows.extend(range(int(cu[k]), int(cu[k + 1])))",
        "mask_rows.extend(min(r + 1, int(cu[k + 1]) - 1) for r in range(int(cu[k]), int(cu[k + 1])))",
        "the worker puts bitmask row i + 1 on logit row i (rows start one late)",
        (*ROWS, *GRAMMAR_E2E),
    ),
    Mutant(
        "deferred-rows-offset",
        "worker/grammar_rows.py",
        "mask_rows.append(int(cu[k]) + min(pos, v))",
        "mask_rows.append(int(cu[k]) + min(pos + 1, v))",
        "deferred (overlap) rows start one late",
        (*ROWS, *OVERLAP),
    ),
    Mutant(
        "fill-rows-ahead",
        "scheduler_client/grammar.py",
        """                if self.terminated:
                    bitmask[start_row + i] = self._eos_row
                else:
                    self._fill(bitmask, start_row + i)
                if i < len(drafts):
                    consumed += self._consume([drafts[i]])
""",
        """                if i < len(drafts):
                    consumed += self._consume([drafts[i]])
                if self.terminated:
                    bitmask[start_row + i] = self._eos_row
                else:
                    self._fill(bitmask, start_row + i)
""",
        "the scheduler's row i is the grammar state after draft i, not before it",
        (*ROWS, *GRAMMAR_E2E),
    ),
    Mutant(
        "width-mismatch-truncated",
        "worker/step_checks.py",
        "elif have != need:",
        "elif have > need:",
        "fewer bitmask rows than positions is not refused as width_mismatch",
        (*ROWS, "tests/test_step_checks.py", "tests/test_worker_lossless.py"),
    ),
    # -- draft validation (scheduler side) ------------------------------------------------------
    Mutant(
        "drafts-past-invalid",
        "scheduler_client/scheduler.py",
        "valid = req.matcher.validate(ids.tolist())",
        "valid = len(ids)",
        "drafts past the first grammar-invalid one are kept",
        (*ROWS, *STALE, *GRAMMAR_E2E),
    ),
    Mutant(
        "deferred-drafts-past-invalid",
        "scheduler_client/bitmask_rows.py",
        "v = req.matcher.validate(raw) if raw else 0",
        "v = len(raw)",
        "overlap mode: deferred drafts past the first grammar-invalid one are kept",
        (*ROWS, *OVERLAP),
    ),
    Mutant(
        "deferred-cap-ignored",
        "worker/runner.py",
        "num_accepted[j] = min(int(num_accepted[j]), cap)",
        "num_accepted[j] = int(num_accepted[j])",
        "the worker accepts deferred drafts past the grammar's valid prefix",
        (*ROWS, *OVERLAP),
    ),
    # -- committed lengths and replay -----------------------------------------------------------
    Mutant(
        "kv-keeps-rejected",
        "worker/runner.py",
        "st.num_computed[slot] += a",
        "st.num_computed[slot] += int(batch.num_drafts[i])",
        "the worker's computed length moves past rejected drafts too (their KV is kept)",
        ("tests/test_worker_lossless.py",),
    ),
    Mutant(
        "kv-blocks-kept-past-length",
        "worker/runner.py",
        "            self.target.kv_cache.trim(slot, int(st.num_computed[slot]))",
        "            pass",
        "rejected drafts' KV blocks stay held: the worker's block count drifts from the scheduler's",
        ("tests/test_paged_cache.py",),
    ),
    Mutant(
        "replay-prompt-only",
        "scheduler_client/scheduler.py",
        "prompt_token_ids=np.asarray(req.prompt_ids + req.output_ids, np.int32)",
        "prompt_token_ids=np.asarray(req.prompt_ids, np.int32)",
        "a request replayed to a new worker is sent its prompt without its committed tokens",
        REPLAY,
    ),
    Mutant(
        "replay-drops-last",
        "scheduler_client/scheduler.py",
        "prompt_token_ids=np.asarray(req.prompt_ids + req.output_ids, np.int32)",
        "prompt_token_ids=np.asarray(req.prompt_ids + req.output_ids[:-1], np.int32)",
        "a replayed request loses its last committed token",
        REPLAY,
    ),
    Mutant(
        "replay-keeps-computed",
        "scheduler_client/scheduler.py",
        """    req.status = Status.WAITING
    req.num_computed = 0
    req.sent_to_worker = False
""",
        """    req.status = Status.WAITING
    req.sent_to_worker = False
""",
        "a requeued request (its worker replaced, or preempted) keeps num_computed, as if the "
        "worker still held its KV",
        REPLAY,
    ),
    # -- DraftTokensHandler (worker/draft_tokens.py) --------------------------------------------
    Mutant(
        "discard-keeps",
        "worker/draft_tokens.py",
        """        if len(keep) == len(self._req_ids):
            return
        self._select(keep)
""",
        """        if len(keep) == len(self._req_ids):
            return
""",
        "discard leaves finished requests' drafts in the next DraftTokenIds",
        ("tests/test_draft_tokens.py",),
    ),
)


def repo_files(root: Path) -> list[str]:
    """Tracked files plus untracked ones git does not ignore (what a commit would hold)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    )
    return sorted({p for p in out.stdout.decode().split("\0") if p})


def copy_tree(root: Path, files: list[str], dest: Path) -> None:
    for rel in files:
        src = root / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet committed
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel, follow_symlinks=False)


def check_snippet(m: Mutant, text: str) -> None:
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(
            f"mutant {m.id}: its snippet occurs {count} times in {m.path} (needs exactly 1); "
            "update tools/mutants.py to the current code"
        )


def plant(tree: Path, m: Mutant) -> None:
    """Apply ``m`` in ``tree``; raises when its snippet does not occur exactly once."""
    path = tree / m.path
    text = path.read_text()
    check_snippet(m, text)
    mutated = text.replace(m.old, m.new)
    compile(mutated, str(path), "exec")  # a typo in the list is ours, not a catch
    path.write_text(mutated)


def selection(tree: Path, m: Mutant | None, full: bool) -> list[str]:
    """pytest arguments for ``m`` (None: every mutant's, for the baseline)."""
    if full:
        return []
    wanted = [*(m.tests if m else [t for x in MUTANTS for t in x.tests]), *CORE]
    args: list[str] = []
    for item in wanted:
        if "::" in item:
            if not (tree / item.split("::")[0]).exists():
                raise SystemExit(f"test {item} of {m.id if m else 'the list'} does not exist")
            found = [item]
        else:
            found = sorted(glob.glob(item, root_dir=tree))
        args += [f for f in found if f not in args]
    return args


def origin(tree: Path, env: dict[str, str], rel: str) -> Path:
    """Where the tests will import ``rel`` from (must be the copy, not an editable install)."""
    mod = rel.removesuffix(".py").replace("/", ".")
    code = f"import importlib.util; print(importlib.util.find_spec({mod!r}).origin)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )
    return Path(out.stdout.strip()).resolve()


@dataclass
class Outcome:
    result: str  # caught, survived, error
    seconds: float
    detail: str


def run_tests(tree: Path, args: list[str], full: bool, timeout_s: float, log: Path) -> Outcome:
    """pytest in ``tree``, its output streamed to ``log`` (tail it to follow a long run)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    # make test's selection: the runs marked long are left out there, so they catch nothing here
    # (the compiled path, in a long test, is one no mutant here plants a bug in); targeted runs
    # also leave out the embedded SmolLM2's tests (slow)
    cmd += ["-m", "not long" if full else "not slow and not long"]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    rc: int | None = None
    with log.open("w") as out:
        print(" ".join(cmd + args), "\n", file=out, flush=True)
        proc = subprocess.Popen(
            cmd + args,
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout or Ctrl-C ends all of it
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    failed = [ln.split(" - ")[0] for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    if rc is None:
        return Outcome("error", seconds, f"timed out after {timeout_s:.0f} s")
    if rc == 0:
        return Outcome("survived", seconds, "")
    if rc in (1, 2) and (failed or rc == 1):  # 2: a collection error (the mutant broke an import)
        return Outcome("caught", seconds, failed[0] if failed else "")
    tail = " | ".join(text.strip().splitlines()[-3:])
    return Outcome("error", seconds, f"pytest exit {rc}: {tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--only", action="append", metavar="ID", help="run this mutant (repeatable)")
    ap.add_argument("--full", action="store_true", help="run the whole suite for each mutant")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    ap.add_argument("--log-dir", type=Path, help="write each run's pytest output here")
    a = ap.parse_args()

    ids = [m.id for m in MUTANTS]
    assert len(set(ids)) == len(ids), "mutant ids must be unique"
    if a.list:
        for m in MUTANTS:
            print(f"{m.id:28} {m.path:32} {m.what}")
        return 0
    unknown = set(a.only or ()) - set(ids)
    if unknown:
        ap.error(f"unknown mutant(s) {sorted(unknown)}; --list shows them")
    todo = [m for m in MUTANTS if not a.only or m.id in a.only]
    if a.log_dir is not None:
        a.log_dir.mkdir(parents=True, exist_ok=True)
    files = repo_files(ROOT)
    mode = "the whole suite" if a.full else "targeted tests"
    print(f"{len(todo)} mutants, {mode}, python {sys.executable}", flush=True)

    def one(m: Mutant | None) -> Outcome:
        name = m.id if m else "baseline"
        with tempfile.TemporaryDirectory(prefix=f"specd-mutant-{name}-") as d:
            tree = Path(d) / "tree"
            tree.mkdir()
            copy_tree(ROOT, files, tree)
            env = {**os.environ, "PYTHONPATH": str(tree)}
            for rel in {m.path} if m else {x.path for x in todo}:
                src = origin(tree, env, rel)
                if src != (tree / rel).resolve():
                    raise SystemExit(f"the tests would import {rel} from {src}, not the copy")
            if m is not None:
                plant(tree, m)
            log = a.log_dir / f"{name}.log" if a.log_dir else Path(d) / "pytest.log"
            print(f"  {name}: running, output in {log}", flush=True)
            return run_tests(tree, selection(tree, m, a.full), a.full, a.timeout, log)

    t_start = time.monotonic()
    for m in todo:  # every snippet must match before anything runs
        check_snippet(m, (ROOT / m.path).read_text())
    if not a.no_baseline:
        base = one(None)
        print(
            f"baseline (no mutant): {base.result} in {base.seconds:.0f} s {base.detail}", flush=True
        )
        if base.result != "survived":
            print("the unmutated tree fails its tests: fix that first", file=sys.stderr)
            return 2
    results: list[tuple[Mutant, Outcome]] = []
    for m in todo:
        o = one(m)
        results.append((m, o))
        print(f"  {m.id:28} {o.result:9} {o.seconds:6.0f} s  {o.detail}", flush=True)

    print(f"\n{'mutant':28} {'result':9} {'seconds':>7}  bug")
    for m, o in results:
        print(f"{m.id:28} {o.result:9} {o.seconds:7.0f}  {m.what}")
    caught = sum(o.result == "caught" for _, o in results)
    print(
        f"\n{caught}/{len(results)} caught, "
        f"{sum(o.result == 'survived' for _, o in results)} survived, "
        f"{sum(o.result == 'error' for _, o in results)} errors; "
        f"{time.monotonic() - t_start:.0f} s in all"
    )
    return 0 if caught == len(results) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes Ctrl-C's way out: tests killed, copy removed


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)  # the tests are killed and the copy removed already (finally, with)
