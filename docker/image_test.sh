#!/usr/bin/env bash
# `make image-test`: build both images on a local Debian base and run a short CPU generation
# through the two containers (--network host, a shared ipc:// folder and model cache).
# Needs root, debootstrap and docker.io (apt-get install -y docker.io debootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-specd-base:bookworm}
WORK=${WORK:-/tmp/specd-image-test}

if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd (no bridge, no iptables)"
  (dockerd --bridge=none --iptables=false >/tmp/specd-dockerd.log 2>&1 &)
  for _ in $(seq 1 30); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  echo "making $BASE with debootstrap"
  rm -rf "$WORK/rootfs" && mkdir -p "$WORK"
  debootstrap --variant=minbase bookworm "$WORK/rootfs" >"$WORK/debootstrap.log"
  tar -C "$WORK/rootfs" -c . | docker import - "$BASE" >/dev/null
fi
mkdir -p docker/.build/wheels
# the CPU torch this machine serves from disk, and the host's CA bundle (TLS through a proxy)
cp -n "$(python3 - <<'PY'
import glob, sys
hits = sorted(glob.glob("/opt/wheels/torch-2.13.0+cpu-cp311-*.whl"))
print(hits[0] if hits else sys.exit("no CPU torch wheel in /opt/wheels"))
PY
)" docker/.build/wheels/
cp /etc/ssl/certs/ca-certificates.crt docker/.build/ca-bundle.crt 2>/dev/null || : >docker/.build/ca-bundle.crt

docker build -q --network host --build-arg BASE="$BASE" -f docker/Dockerfile.worker -t specd-worker:test .
docker build -q --network host --build-arg BASE="$BASE" -f docker/Dockerfile.scheduler -t specd-scheduler:test .

rm -rf "$WORK/run" "$WORK/cache" && mkdir -p "$WORK/run" "$WORK/cache" && chown -R 10001 "$WORK/run" "$WORK/cache"
docker rm -f specd-worker-test >/dev/null 2>&1 || true
trap 'docker rm -f specd-worker-test >/dev/null 2>&1 || true' EXIT
docker run -d --name specd-worker-test --network host -v "$WORK/run:/run/specd" \
  -v "$WORK/cache:/var/lib/specd/cache" specd-worker:test --model embedded:smollm2 \
  --listen ipc:///run/specd/worker.sock --max-model-len 512 --max-num-seqs 4 >/dev/null
for _ in $(seq 1 60); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' specd-worker-test)" = healthy ] && break
  docker inspect -f '{{.State.Running}}' specd-worker-test | grep -q true || { docker logs specd-worker-test; exit 1; }
  sleep 5
done
echo "worker container: $(docker inspect -f '{{.State.Health.Status}}' specd-worker-test)"
docker run --rm --network host -v "$WORK/run:/run/specd" -v "$WORK/cache:/var/lib/specd/cache:ro" \
  --entrypoint specd specd-scheduler:test run --worker ipc:///run/specd/worker.sock \
  --chat "What is the capital of France?" --max-tokens 16 --choice Paris London Berlin \
  | tee "$WORK/out.jsonl"
python3 - "$WORK/out.jsonl" <<'PY'
import json, sys
first = json.loads(open(sys.argv[1]).readline())
assert first["error"] is None and first["text"] in ("Paris", "London", "Berlin"), first
PY
docker run --rm --network host -v "$WORK/run:/run/specd" --entrypoint specd specd-scheduler:test \
  health ipc:///run/specd/worker.sock

# The scheduler daemon: its HTTP API from the host, then `docker stop` (SIGTERM) drains, exits 0.
PORT=${SPECD_TEST_PORT:-18123}
docker rm -f specd-scheduler-test >/dev/null 2>&1 || true
trap 'docker rm -f specd-worker-test specd-scheduler-test >/dev/null 2>&1 || true' EXIT
docker run -d --name specd-scheduler-test --network host -v "$WORK/run:/run/specd" \
  -v "$WORK/cache:/var/lib/specd/cache:ro" \
  -e SPECD_PORT="$PORT" specd-scheduler:test --worker ipc:///run/specd/worker.sock --port "$PORT" >/dev/null
for _ in $(seq 1 60); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' specd-scheduler-test)" = healthy ] && break
  docker inspect -f '{{.State.Running}}' specd-scheduler-test | grep -q true || { docker logs specd-scheduler-test; exit 1; }
  sleep 2
done
echo "scheduler container: $(docker inspect -f '{{.State.Health.Status}}' specd-scheduler-test)"
python3 - "$PORT" <<'PY'
import json, sys, urllib.request
body = {"messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 8,
        "temperature": 0, "guided_choice": ["Paris", "London", "Berlin"]}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions",
                             data=json.dumps(body).encode())
out = json.load(urllib.request.urlopen(req, timeout=120))
print(json.dumps(out["choices"][0]))
assert out["choices"][0]["message"]["content"] in ("Paris", "London", "Berlin"), out
PY
docker stop -t 60 specd-scheduler-test >/dev/null
echo "scheduler container exit code: $(docker inspect -f '{{.State.ExitCode}}' specd-scheduler-test)"
[ "$(docker inspect -f '{{.State.ExitCode}}' specd-scheduler-test)" = 0 ]
echo "image-test passed"
