#!/usr/bin/env bash
# `make demo`: a real local Ray cluster with token auth, the training smoke job sent with
# `ray job submit` exactly as on a remote cluster, its summary, then the cluster down.
# KEEP_CLUSTER=1 leaves the cluster running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAYFLEET_HOME="${RAYFLEET_HOME:-$HOME/.rayfleet}"
RUNS="${RAYFLEET_STORAGE:-$PWD/runs}"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

started_here=0
if ! rayfleet local env >/dev/null 2>&1; then started_here=1; fi
cleanup() {
  if [ "$started_here" = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    step "rayfleet local down"
    rayfleet local down
  fi
}
trap cleanup EXIT

step "rayfleet local up"
rayfleet local up --num-cpus "${DEMO_CPUS:-4}" --object-store-memory 1GB
eval "$(rayfleet local env)"

step "ray job submit --working-dir . -- python -m workloads.train --smoke-test"
t0=$(date +%s)
ray job submit --working-dir . -- python -m workloads.train --smoke-test \
  --storage-path "$RUNS" --name "demo-$(date +%Y%m%d-%H%M%S)" | tee /tmp/rayfleet-demo-train.log \
  | grep -E '^\[rayfleet\]|\(RayTrainWorker.*\[rayfleet\]|^== run|^  |Job .* (succeeded|failed)'
t1=$(date +%s)

step "summary"
python - "$t0" "$t1" <<'PY'
import json, sys
line = [l for l in open("/tmp/rayfleet-demo-train.log") if l.startswith("RAYFLEET_SUMMARY ")][-1]
s = json.loads(line.split(" ", 1)[1])
print(f"  training job   {s['name']}: {s['steps']} steps, loss {s['first_loss']:.3f} -> "
      f"{s['final_loss']:.3f}, {int(sys.argv[2]) - int(sys.argv[1])}s through ray job submit")
print(f"  checkpoint     {s['checkpoint']}")
print(f"  loss curve     {s['loss_png']}")
PY
echo "  dashboard      ${RAY_API_SERVER_ADDRESS} (token in ${RAY_AUTH_TOKEN_PATH})"
echo "  more jobs      eval \"\$(rayfleet local env)\"; ray job submit --working-dir . -- python -m workloads.train --help"
