#!/usr/bin/env bash
# `make demo`: the whole lifecycle on one real local Ray cluster (token auth), each stage
# through the command a cluster user would type:
#   rayfleet local up -> ray job submit workloads.data -> ray job submit workloads.train
#   (streaming the data output, 2 workers) -> serve deploy the `lm` app with the trained
#   checkpoint -> one question through the `openai` client -> summary -> cluster down.
# KEEP_CLUSTER=1 leaves the cluster (and the endpoint) running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAYFLEET_HOME="${RAYFLEET_HOME:-$HOME/.rayfleet}"
RUNS="${RAYFLEET_STORAGE:-$PWD/runs}"
DATA="$RUNS/data/smoke-seq64"
STAMP="$(date +%Y%m%d-%H%M%S)"
LOGS="$RUNS/demo-logs/$STAMP"
mkdir -p "$LOGS"

T_START=$(date +%s)
source scripts/demo_cluster.sh

step "ray job submit -- python -m workloads.data --smoke-test (Ray Data: read, clean, tokenize, pack)"
t=$(now)
ray job submit --working-dir . -- python -m workloads.data --smoke-test --output "$DATA" \
  > "$LOGS/data.log" 2>&1 || { tail -40 "$LOGS/data.log"; exit 1; }
grep -E '^\[rayfleet\]' "$LOGS/data.log" || true
T_DATA=$(( $(now) - t ))

step "ray job submit -- python -m workloads.train --smoke-test --dataset $DATA (2 workers)"
t=$(now)
# Smoke-sized model, but enough steps (a few seconds each hundred) to answer in Python-ish.
ray job submit --working-dir . -- python -m workloads.train --smoke-test --num-workers 2 \
  --max-steps "${DEMO_STEPS:-300}" --checkpoint-every 100 --log-every 50 --dataset "$DATA" --storage-path "$RUNS" --name "demo-$STAMP" > "$LOGS/train.log" 2>&1 \
  || { tail -40 "$LOGS/train.log"; exit 1; }
grep -E '^\[rayfleet\]|\(RayTrainWorker.*\[rayfleet\]' "$LOGS/train.log" | sed 's/^.*\[rayfleet\]/[rayfleet]/' || true
T_TRAIN=$(( $(now) - t ))
CHECKPOINT=$(python - "$LOGS/train.log" <<'PY'
import json, sys
line = [l for l in open(sys.argv[1]) if l.startswith("RAYFLEET_SUMMARY ")][-1]
print(json.loads(line.split(" ", 1)[1])["checkpoint"])
PY
)

step "serve deploy cluster-configs/serve/lm.yaml (checkpoint $CHECKPOINT)"
t=$(now)
SERVE_PORT="${SERVE_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
# A copy of the checked-in config with this run's checkpoint and a free loopback port.
python - "$CHECKPOINT" "$SERVE_PORT" "$LOGS/lm.yaml" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open("cluster-configs/serve/lm.yaml"))
cfg["http_options"]["port"] = int(sys.argv[2])
cfg["applications"][0]["args"]["checkpoint"] = sys.argv[1]
yaml.safe_dump(cfg, open(sys.argv[3], "w"), sort_keys=False)
PY
serve deploy "$LOGS/lm.yaml"
BASE="http://127.0.0.1:$SERVE_PORT"
for _ in $(seq 180); do
  if curl -sf "$BASE/health" >/dev/null 2>&1; then break; fi
  sleep 1
done
curl -sf "$BASE/health" >/dev/null || { serve status; echo "lm app did not become healthy"; exit 1; }
T_SERVE=$(( $(now) - t ))

step "ask it a question with the openai client"
t=$(now)
python - "$BASE/v1" <<'PY'
import sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="not-needed-locally")
question = "How do I open a file?"
r = client.chat.completions.create(model="rayfleet-lm", max_tokens=120, temperature=1.0,
                                   messages=[{"role": "user", "content": question}], seed=0)
print(f"  Q: {question}")
print("  A: " + r.choices[0].message.content.replace("\n", "\n     "))
code = "def read_lines(path):\n"
c = client.completions.create(model="rayfleet-lm", prompt=code, max_tokens=120,
                              temperature=0.7, seed=0)
print("  completion of 'def read_lines(path):' ->")
print("     " + (code + c.choices[0].text).replace("\n", "\n     "))
print(f"  ({r.usage.completion_tokens} tokens from a {r.model} trained minutes ago; it has "
      "read a little Python, so expect Python-flavoured bytes)")
PY
T_ASK=$(( $(now) - t ))

step "summary"
python - "$LOGS/data.log" "$LOGS/train.log" <<'PY'
import json, sys
def summary(path):
    line = [l for l in open(path) if l.startswith("RAYFLEET_SUMMARY ")][-1]
    return json.loads(line.split(" ", 1)[1])
d, s = summary(sys.argv[1]), summary(sys.argv[2])
print(f"  data           {d['rows']} sequences x {d['seq_len'] + 1} tokens in {d['output']} "
      f"({d['written']} shards written, {d['skipped']} reused)")
print(f"  training       {s['name']}: {s['steps']} steps, loss {s['first_loss']:.3f} -> "
      f"{s['final_loss']:.3f}")
print(f"  checkpoint     {s['checkpoint']}")
print(f"  loss curve     {s['loss_png']}")
PY
echo "  stage times    up ${T_UP}s, data ${T_DATA}s, train ${T_TRAIN}s, serve ${T_SERVE}s, ask ${T_ASK}s; total $(( $(now) - T_START ))s"
echo "  dashboard      ${RAY_DASHBOARD_ADDRESS} (token in ${RAY_AUTH_TOKEN_PATH})"
echo "  logs           $LOGS"
if [ "${KEEP_CLUSTER:-0}" = 1 ] || [ "$started_here" = 0 ]; then
  echo "  more requests  curl $BASE/v1/completions -H 'Content-Type: application/json' \\"
  echo "                   -d '{\"model\": \"rayfleet-lm\", \"prompt\": \"def \", \"max_tokens\": 40}'"
  echo "                 or openai.OpenAI(base_url=\"$BASE/v1\", api_key=\"x\"); batch sizes: $BASE/v1/stats"
else
  echo "  more requests  KEEP_CLUSTER=1 make demo keeps the endpoint up; then POST $BASE/v1/completions"
fi
