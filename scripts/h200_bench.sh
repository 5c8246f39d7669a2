#!/usr/bin/env bash
# H200 evidence for issue 6 (and issue 5's acceptance when the demo model is present), everything under "$OUT".
# Usage on the device machine, from the repository root, PYTHONPATH=src already set:
#   LATTICE_GIT_REV=<rev> bash scripts/h200_bench.sh
# Each step has its own time limit and the whole script stops starting steps at DEADLINE seconds (default 465),
# so it ends inside 8 minutes; a failed or timed-out optional step is logged and the next one runs.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lattice_bench}
DEADLINE=${DEADLINE:-465}
LOCK=${LATTICE_BENCH_LOCK:-/tmp/lattice_mlx_bench.lock}
mkdir -p "$OUT"
BENCH=(python -m lattice_mlx.bench --lock "$LOCK")
SUMMARY="$OUT/steps.txt"
: > "$SUMMARY"

step() {  # step NAME LIMIT_S ARGS...: one benchmark process, bounded by its limit and the global deadline
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 15)); then
    echo "$name: skipped, ${left}s left before the deadline" | tee -a "$SUMMARY"
    return
  fi
  echo "== $name (limit ${limit}s, t=${SECONDS}s)"
  local start=$SECONDS
  timeout --signal=INT --kill-after=5 "$limit" "${BENCH[@]}" "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.log"
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - start))s" | tee -a "$SUMMARY"
  tail -n 1 "$OUT/$name.stdout" | cut -c1-400
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
  python -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device(), mx.device_info())" 2>&1
} > "$OUT/device.txt"
cat "$OUT/device.txt"

# 1. Qwen3.5-0.8B shape, Q4 g64, bf16, random weights: stock vs plain vs MTP sequential/batched, K=1..4 + adaptive,
#    MTP drafts forced to per-position acceptance 0.8 (synthetic), greedy, 5 repetitions ABBA.
step decode_0.8b 140 decode --model 0.8b --reps 5 --lengths 24,120 --temps 0 --oracle-p 0.8 --out "$OUT/0.8b"

# (order: what the issues need most runs first; later steps are skipped at the deadline)
# 5. The trained demo model, if it has landed: live acceptance (issue 5) and plain vs MTP tok/s.
if [ -f src/lattice_mlx/assets/demo/config.json ]; then
  step acceptance_demo 70 acceptance --model demo --reps 5 --prompts 20 --k 1,2,3,4 --temps 0,0.7 \
    --hidden post,pre --lengths 8,40 --out "$OUT/demo"
  step decode_demo 30 decode --model demo --reps 5 --lengths 16,96 --workloads code --temps 0 \
    --legs stock,plain,sequential,batched --k 2,adaptive --out "$OUT/demo"
else
  echo "demo: skipped, src/lattice_mlx/assets/demo/config.json not present" | tee -a "$SUMMARY"
fi

# 2. The synthetic speedup curve: p in {0..1} x K=1..4, batched verifier, against plain in the same rotation.
step oracle_0.8b 150 oracle --model 0.8b --reps 5 --lengths 24,120 --no-stock --out "$OUT/0.8b"

# 3. Prefill at 128 / 512 / 2048 tokens, stock vs plain.
step prefill_0.8b 45 prefill --model 0.8b --reps 5 --out "$OUT/0.8b"

# 4. Temperature 0.7 (real MTP head on random weights, so acceptance ~0: this is MTP's cost when drafts miss).
step decode_0.8b_t07 45 decode --model 0.8b --reps 5 --lengths 24,120 --temps 0.7 --legs stock,plain,batched \
  --k 2,adaptive --out "$OUT/0.8b_t07"

echo "done in ${SECONDS}s; results under $OUT" | tee -a "$SUMMARY"
