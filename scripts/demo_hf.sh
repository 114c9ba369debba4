#!/usr/bin/env bash
# `make demo-hf`: the Hugging Face line on one real local Ray cluster (token auth), each stage
# through the command a cluster user would type (README's "Your own Hugging Face model"):
#   a stand-in model folder (tiny Llama + BPE tokenizer, made offline) and instruction records
#   -> ray job submit workloads.data --tokenizer --shape instruction
#   -> ray job submit workloads.train --model <folder> --strategy fsdp (2 workers, hf/ export)
#   -> serve deploy the `lm` app on the export -> a chat answer through the `openai` client
#   -> the vLLM `llm` config for the same export -> summary -> cluster down.
# KEEP_CLUSTER=1 leaves the cluster (and the endpoint) running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAYFLEET_HOME="${RAYFLEET_HOME:-$HOME/.rayfleet}"
RUNS="${RAYFLEET_STORAGE:-$PWD/runs}"
STAMP="$(date +%Y%m%d-%H%M%S)"
LOGS="$RUNS/demo-logs/hf-$STAMP"
MODEL="$RUNS/tiny-llama"
DATA="$RUNS/data/sft-$STAMP"
NAME="sft-demo-$STAMP"
mkdir -p "$LOGS"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
now() { date +%s; }
T_START=$(now)
summary() { python - "$1" "$2" <<'PY'
import json, sys
line = [l for l in open(sys.argv[1]) if l.startswith("RAYFLEET_SUMMARY ")][-1]
print(json.loads(line.split(" ", 1)[1])[sys.argv[2]])
PY
}

started_here=0
if ! rayfleet local env >/dev/null 2>&1; then started_here=1; fi
cleanup() {
  if [ "$started_here" = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    step "rayfleet local down"
    serve shutdown -y >/dev/null 2>&1 || true
    rayfleet local down
  fi
}
trap cleanup EXIT

if [ "$started_here" = 1 ]; then
  step "rayfleet local up"
  rayfleet local up --num-cpus "${DEMO_CPUS:-4}" --object-store-memory 1GB
else
  step "using the running rayfleet local cluster"
fi
eval "$(rayfleet local env)"

step "a stand-in for your model and data: tiny Llama + BPE tokenizer, instruction records"
python -m workloads.common.tiny_hf --output "$MODEL" --sft "$RUNS/sft.jsonl"

step "ray job submit -- python -m workloads.data --tokenizer $MODEL --shape instruction"
t=$(now)
ray job submit --working-dir . -- python -m workloads.data --input "$RUNS/sft.jsonl" \
  --shape instruction --tokenizer "$MODEL" --max-length 48 --output "$DATA" \
  > "$LOGS/data.log" 2>&1 || { tail -40 "$LOGS/data.log"; exit 1; }
grep -E '^\[rayfleet\]' "$LOGS/data.log" || true
T_DATA=$(( $(now) - t ))

step "ray job submit -- python -m workloads.train --model $MODEL --strategy fsdp (2 workers)"
t=$(now)
ray job submit --working-dir . -- python -m workloads.train --model "$MODEL" --dataset "$DATA" \
  --strategy fsdp --max-steps "${DEMO_STEPS:-100}" --lr 3e-3 --log-every 20 \
  --storage-path "$RUNS" --name "$NAME" > "$LOGS/train.log" 2>&1 \
  || { tail -40 "$LOGS/train.log"; exit 1; }
grep -E '\[rayfleet\] step|== run' "$LOGS/train.log" | sed 's/^.*\[rayfleet\]/[rayfleet]/' || true
T_TRAIN=$(( $(now) - t ))
EXPORT=$(summary "$LOGS/train.log" hf_export)

step "serve deploy cluster-configs/serve/lm.yaml (checkpoint $EXPORT)"
t=$(now)
rayfleet serve-config cluster-configs/serve/lm.yaml --arg "checkpoint=$EXPORT" \
  -o "$LOGS/lm.yaml" > /dev/null
SERVE_PORT="${SERVE_PORT:-$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
sed -i "s/port: 8000/port: $SERVE_PORT/" "$LOGS/lm.yaml"
serve deploy "$LOGS/lm.yaml"
BASE="http://127.0.0.1:$SERVE_PORT"
for _ in $(seq 180); do
  if curl -sf "$BASE/health" >/dev/null 2>&1; then break; fi
  sleep 1
done
curl -sf "$BASE/health" >/dev/null || { serve status; echo "lm app did not become healthy"; exit 1; }
T_SERVE=$(( $(now) - t ))

step "ask the fine-tuned model with the openai client"
python - "$BASE/v1" <<'PY'
import sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="not-needed-locally")
for word in ("golf", "echo"):
    q = f"Repeat the word {word} twice."
    r = client.chat.completions.create(model="rayfleet-lm", max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": q}])
    print(f"  Q: {q}\n  A: {r.choices[0].message.content}")
PY

step "the vLLM config for the same export (validated offline)"
python -m workloads.serve.llm_config --model-id "$NAME" --model-source "$EXPORT" \
  --max-model-len 256 --output "$LOGS/llm.yaml"

step "summary"
echo "  model          $(summary "$LOGS/train.log" name): loss $(summary "$LOGS/train.log" first_loss) -> $(summary "$LOGS/train.log" final_loss)"
echo "  hf export      $EXPORT"
echo "  stage times    data ${T_DATA}s, train ${T_TRAIN}s, serve ${T_SERVE}s; total $(( $(now) - T_START ))s"
echo "  logs           $LOGS (vLLM config: $LOGS/llm.yaml)"
