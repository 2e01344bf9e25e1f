#!/bin/bash
# BENCHMARKS.md "Real traces": kvshard against vLLM online on the Mooncake synthetic trace, then TP=2 against
# TP=2 + DCP=2 on the same trace, the load average logged around each:
#   VLLM_PY=/path/to/vllm-venv/bin/python scripts/run_trace_benchmarks.sh [RESULTS_DIR]
cd "$(dirname "$0")/.."
set -e
R=${1:-bench-results/traces}
T=traces/mooncake_synthetic_trace.jsonl
PY=.venv/bin/python
mkdir -p $R
step() { echo "### $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): $*"; "$@"; echo "### done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"; }
# 16 conversations of the trace, 8 in flight, prefix caching on in both engines, each engine twice, alternating
step $PY scripts/trace_vs_vllm.py --model smollm2-135m-instruct --dtype float32 --context-scale 1/16 --out $R/smollm2-float32
step $PY scripts/trace_vs_vllm.py --model smollm2-135m-instruct --dtype bfloat16 --context-scale 1/16 --out $R/smollm2-bfloat16
step $PY scripts/trace_vs_vllm.py --model kvshard-demo-gqa --dtype bfloat16 --context-scale 1/8 --out $R/gqa-bfloat16
# TP=2 vs TP=2 + DCP=2 on the trace's conversations, swept until both layouts saturate
step .venv/bin/kvshard bench dcp kvshard-demo-gqa -tp 2 --dcp 2 --workload trace --trace $T --context-scale 1/64 \
     --output-scale 1/4 --trace-conversations 512 --kv-cache-memory 4MiB --concurrency 1,2,4,8 --output-dir $R/dcp \
     --no-progress
