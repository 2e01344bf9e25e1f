#!/bin/bash
# The cost of structured outputs (BENCHMARKS.md, "Structured outputs: the cost of the constraint"): output tok/s
# and TPOT with a JSON-schema constraint on every request against none, at 1 and 32 concurrent requests, on one
# `kvshard serve` of SmolLM2-135M-Instruct at tp=2, dcp=2 (its 49,152-token vocabulary is what a mask costs).
# The four points run REPEATS times, alternating, after an untimed warm-up (the first constrained request builds
# the vocabulary's tables and compiles the schema); one table at the end.
#   scripts/structured_cost.sh [RESULTS_DIR]
# Environment: NUM_PROMPTS (default 64), INPUT_LEN (512), OUTPUT_LEN (128), REPEATS (2), PORT (8123).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's kvshard, whatever the venv installed
K=".venv/bin/python -m kvshard.entrypoints.cli"
R=${1:-bench-results/structured}
NUM_PROMPTS=${NUM_PROMPTS:-64}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-128}
REPEATS=${REPEATS:-2}
PORT=${PORT:-8123}
URL=http://127.0.0.1:$PORT
# An array of at least 16 small objects: always longer than OUTPUT_LEN tokens, so that a constrained request is
# cut at OUTPUT_LEN as an unconstrained one is (ignore_eos) and both generate the same number of tokens.
SCHEMA='{"type": "array", "minItems": 16, "items": {"type": "object", "additionalProperties": false,
  "required": ["id", "name", "tags"], "properties": {"id": {"type": "integer"},
  "name": {"type": "string", "maxLength": 24}, "tags": {"type": "array", "maxItems": 3,
  "items": {"enum": ["red", "green", "blue"]}}}}}'
EXTRA="{\"structured_outputs\": {\"json\": $SCHEMA}}"
mkdir -p "$R"

$K serve smollm2-135m-instruct -tp 2 --dcp 2 --max-model-len 2048 --kv-cache-memory 1GiB --port "$PORT" \
    > "$R/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 900); do
  curl -sf "$URL/health" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { cat "$R/server.log"; exit 1; }
  sleep 1
done
curl -sf "$URL/health" > /dev/null || { echo "the server did not come up: $R/server.log"; exit 1; }

bench() {  # bench NAME CONCURRENCY [--extra-body JSON]
  local name=$1 concurrency=$2
  shift 2
  echo "### $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): $name"
  $K bench serve --base-url "$URL" --workload random --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --num-prompts "$NUM_PROMPTS" --max-concurrency "$concurrency" --no-progress --result-file "$R/$name.json" \
      "$@" > "$R/$name.txt" || echo "  some requests failed: $R/$name.txt"
}

NUM_PROMPTS=2 bench warmup-none 2
NUM_PROMPTS=2 bench warmup-schema 2 --extra-body "$EXTRA"
for rep in $(seq "$REPEATS"); do
  for concurrency in 1 32; do
    bench "none-c$concurrency-$rep" "$concurrency"
    bench "schema-c$concurrency-$rep" "$concurrency" --extra-body "$EXTRA"
  done
done

.venv/bin/python - "$R" <<'EOF'
import json, pathlib, sys

rows = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*-c*-*.json")):
    mode, concurrency, _ = path.stem.split("-")
    result = json.loads(path.read_text())
    rows.setdefault((int(concurrency[1:]), mode), []).append(result)
print("| concurrency | constraint | runs | output tok/s | mean TPOT (ms) | median TPOT (ms) | tokens | failed |")
print("|---|---|---|---|---|---|---|---|")
for (concurrency, mode), results in sorted(rows.items()):
    print(f"| {concurrency} | {'JSON schema' if mode == 'schema' else 'none'} | {len(results)} | "
          + " / ".join(f"{r['output_throughput']:.1f}" for r in results) + " | "
          + " / ".join(f"{r['mean_tpot_ms']:.1f}" for r in results) + " | "
          + " / ".join(f"{r['median_tpot_ms']:.1f}" for r in results) + " | "
          + " / ".join(str(r["total_output_tokens"]) for r in results) + " | "
          + " / ".join(str(r["failed"]) for r in results) + " |")
EOF
