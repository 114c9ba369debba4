#!/usr/bin/env bash
# `make demo-hf`: the "Your own Hugging Face model" section of docs/workloads.md, its blocks
# run as written (scripts/readme_blocks.py reads them from the page, the same way
# tests/cluster/test_readme.py runs them), on a real local Ray cluster with token auth:
#   a stand-in model folder (tiny Llama + BPE tokenizer, made offline) and instruction records
#   -> ray job submit workloads.data --tokenizer --shape instruction
#   -> ray job submit workloads.train --model <folder> --strategy fsdp (2 workers, hf/ export)
#   -> serve deploy lm (checkpoint: latest, the export) -> an answer through the openai client
#   -> the `llm` app (vLLM's CPU build) on the same export -> the same answer
#   -> `rag` over that engine (generator: llm) -> an answer with its sources
#   -> the A100 `llm` config for the same export -> cluster down.
# KEEP_CLUSTER=1 leaves the cluster (and the endpoint on 127.0.0.1:8000) running afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAYFLEET_HOME="${RAYFLEET_HOME:-$HOME/.rayfleet}"
STAMP="$(date +%Y%m%d-%H%M%S)"
LOGS="${RAYFLEET_STORAGE:-$PWD/runs}/demo-logs/hf-$STAMP"
mkdir -p "$LOGS"
T_START=$(date +%s)
source scripts/demo_cluster.sh

python scripts/readme_blocks.py "Your own Hugging Face model" > "$LOGS/readme-blocks.sh"
step "docs/workloads.md's Hugging Face section, as written ($LOGS/readme-blocks.sh)"
bash -e -o pipefail "$LOGS/readme-blocks.sh" 2>&1 | tee "$LOGS/demo.log" \
  | grep -E '^\[rayfleet\]|\[rayfleet\] (step|run)|== run|  (loss|checkpoint|hf export) |^A: |^vLLM: |^sources: |^RAG: |Sent deploy'
echo "  total $(( $(date +%s) - T_START ))s; full output in $LOGS/demo.log"
