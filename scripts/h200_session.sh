#!/usr/bin/env bash
# One device call's worth of GPU checks, results under $OUT (one tarball, since $OUT returns few files).
# Usage (device machine, repo root, PYTHONPATH set): bash scripts/h200_session.sh tests|profile|bench|next|next2|final|extra|diag|again
set -u
export PYTHONUNBUFFERED=1
mode=$1
R=/tmp/res/$mode
mkdir -p "$R"
B=(python3 -m lattice_mlx.bench --lock /tmp/lattice_bench.lock)
step() {  # step NAME LIMIT CMD...: one bounded process (bench/next modes), logged under $R, none after DEADLINE
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS)); ((left < limit)) && limit=$left
  if ((limit < 15)); then echo "$name: skipped (deadline)" | tee -a "$R/steps.txt"; return; fi
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$R/$name.out" 2> "$R/$name.log"
  echo "$name: rc=$? in $((SECONDS - t0))s (limit $limit)" | tee -a "$R/steps.txt"
}
case $mode in
tests)
  # new kernels first (conv-fused GDN, tree GDN, attention), then the model-level checks with every kernel on
  timeout 120 python3 -m pytest -q -x tests/metal/test_gated_delta.py -k "conv or matches_ref or step_states" 2>&1 | tail -15 > "$R/pytest_gdn.txt"
  timeout 100 python3 -m pytest -q tests/metal/test_gated_delta_tree.py 2>&1 | tail -15 > "$R/pytest_tree.txt"
  timeout 150 python3 -m pytest -q tests/metal/test_attention.py -k "(matches_ref and (D256 or fp32-causal)) or any_split or qwen" 2>&1 | tail -15 > "$R/pytest_attention.txt"
  timeout 120 python3 -m pytest -q tests/metal/test_model_kernels.py tests/metal/test_q4_matmul.py -k "not drift" 2>&1 | tail -15 > "$R/pytest_model.txt"
  tail -n 3 "$R"/pytest_*.txt
  ;;
profile)
  timeout 330 python3 scripts/h200_profile.py --out "$R" > "$R/profile.log" 2>&1
  tail -n 60 "$R/profile.log"
  ;;
bench)
  # Issue 6/8/9 evidence; each step bounded, the whole mode ends by DEADLINE seconds.
  DEADLINE=${DEADLINE:-500}
  BIG=${BIG:-0.8b}  # a smaller shape for a CPU dry run
  step model_test 45 python3 -m pytest -q tests/metal/test_model_kernels.py -k logits
  step decode_0.8b 110 "${B[@]}" decode --model "$BIG" --reps 5 --lengths 16,96 --temps 0 --legs stock,plain,batched \
    --k 2,3 --oracle-p 0.8 --out "$R/0.8b"
  step oracle_0.8b 80 "${B[@]}" oracle --model "$BIG" --reps 3 --lengths 16,96 --oracle-ps 0,0.5,0.8,1 --k 1,2,3 \
    --no-stock --out "$R/0.8b"
  step decode_demo 70 "${B[@]}" decode --model demo --reps 5 --lengths 16,96 --workloads code,prose --temps 0,0.7 \
    --legs stock,plain,sequential,batched --k 2,adaptive --out "$R/demo"
  step acceptance_demo 50 "${B[@]}" acceptance --model demo --reps 1 --prompts 20 --k 1,2,3 --temps 0,0.7 \
    --hidden post --lengths 8,40 --out "$R/demo"
  step drafters 50 python3 scripts/bench_drafters.py --out "$R/drafters" --prompts 6 --tokens 64
  step tree 50 python3 scripts/bench_tree.py --out "$R/tree" --prompts 6 --tokens 48
  step prefill_0.8b 30 "${B[@]}" prefill --model "$BIG" --reps 3 --out "$R/0.8b"
  cat "$R/steps.txt"
  ;;
next)
  # Run 3, first call: the open tree measurement (#9) first, then the compiled path on the GPU and its A/B.
  DEADLINE=${DEADLINE:-520}
  BIG=${BIG:-0.8b}
  step tree_0.8b 180 python3 scripts/bench_tree.py --out "$R/tree_0.8b" --model "$BIG" --oracle-p 0.8 --prompts 3
  step compiled_tests 90 python3 -m pytest -q tests/test_compiled.py tests/metal/test_model_kernels.py
  step decode_0.8b 150 "${B[@]}" decode --model "$BIG" --reps 5 --lengths 16,96 --temps 0 \
    --legs stock,plain,sequential,batched --k 2,3,adaptive --oracle-p 0.8 --compile-ab --out "$R/0.8b"
  step oracle_0.8b 110 "${B[@]}" oracle --model "$BIG" --reps 3 --lengths 16,96 --oracle-ps 0,0.5,0.8,1 --k 2,3 \
    --no-stock --compile-ab --out "$R/0.8b"
  cat "$R/steps.txt"
  ;;
next2)
  # Run 3, second call (warm machine): demo with compile A/B, demo trees, first-call cost, new kernels, 4B shape.
  DEADLINE=${DEADLINE:-560}
  BIG=${BIG:-0.8b}
  step decode_demo 80 "${B[@]}" decode --model demo --reps 5 --lengths 16,96 --workloads code --temps 0,0.7 \
    --legs stock,plain,batched --k 2,adaptive --compile-ab --out "$R/demo"
  step tree_demo 70 python3 scripts/bench_tree.py --out "$R/tree_demo" --prompts 6 --tokens 48
  step first_call 40 python3 scripts/first_call.py --out "$R/first_call.json"
  step kernels_new 120 python3 scripts/bench_kernels.py --ops conv,attention,tree --out "$R/kernels_new.json"
  step decode_4b 150 "${B[@]}" decode --model 4b --reps 5 --lengths 16,96 --temps 0 --legs stock,plain,batched \
    --k 2 --oracle-p 0.8 --compile-ab --out "$R/4b"
  cat "$R/steps.txt"
  ;;
final)
  # Run 4 (compile on by default): the compiled path's GPU tests with failures spelled out, first-call cost by op,
  # demo and 0.8B decode with the compile A/B.
  DEADLINE=${DEADLINE:-520}
  BIG=${BIG:-0.8b}
  step compiled_tests 200 python3 -m pytest -q -rf --tb=short tests/test_compiled.py tests/metal/test_model_kernels.py
  step first_call 60 python3 scripts/first_call.py --out "$R/first_call.json"
  step decode_demo 120 "${B[@]}" decode --model demo --reps 5 --lengths 16,96 --workloads code --temps 0,0.7 \
    --legs stock,plain,batched --k 2,adaptive --compile-ab --out "$R/demo"
  step decode_0.8b 130 "${B[@]}" decode --model "$BIG" --reps 7 --lengths 16,96 --temps 0 --legs plain,batched \
    --k 2,3 --oracle-p 0.8 --compile-ab --no-stock --out "$R/0.8b"
  cat "$R/steps.txt"; grep -E "passed|failed|FAILED|Error" "$R/compiled_tests.out" | tail -8
  ;;
extra)
  # Leftover time (warm machine): the 4B shape and the oracle curve, compiled by default.
  DEADLINE=${DEADLINE:-400}
  BIG=${BIG:-0.8b}
  step oracle_0.8b 150 "${B[@]}" oracle --model "$BIG" --reps 3 --lengths 16,96 --oracle-ps 0.5,0.8,1 --k 2,3 \
    --no-stock --out "$R/0.8b"
  step decode_4b 150 "${B[@]}" decode --model 4b --reps 5 --lengths 16,96 --temps 0 --legs plain,batched \
    --k 2 --oracle-p 0.8 --no-stock --out "$R/4b"
  cat "$R/steps.txt"
  ;;
diag)
  # Run 4 follow-up: where compiled verify differs on the GPU, the model-level kernel tests with durations, and the
  # first request's one-off cost with and without the compiled path (fresh processes).
  DEADLINE=${DEADLINE:-520}
  step compiled_tests 120 python3 -m pytest -q -rf --tb=short tests/test_compiled.py
  step compiled_diag 150 python3 scripts/compiled_diag.py --out "$R/compiled_diag.json"
  step model_kernels 200 python3 -m pytest -q -rf --tb=short --durations=0 tests/metal/test_model_kernels.py
  step first_gen_layers 50 env LATTICE_COMPILE=0 python3 scripts/first_generate.py --mtp --out "$R/first_gen_layers.json"
  step first_gen_compiled 50 env LATTICE_COMPILE=1 python3 scripts/first_generate.py --mtp --out "$R/first_gen_compiled.json"
  cat "$R/steps.txt"; cat "$R/compiled_diag.out" | tr -d '\n ' | head -c 1500; echo; tail -n 25 "$R/model_kernels.out"
  cat "$R"/first_gen_*.out
  ;;
again)
  # Run 4, last call: the 0.8B oracle decode again (compiled by default), to weigh runs 3 and 4 against each other.
  DEADLINE=${DEADLINE:-170}
  step decode_0.8b 150 "${B[@]}" decode --model "${BIG:-0.8b}" --reps 9 --lengths 16,96 --temps 0 \
    --legs plain,batched --k 2,3 --oracle-p 0.8 --no-stock --out "$R/0.8b"
  cat "$R/steps.txt"
  ;;
esac
tar -czf "$OUT/$mode.tgz" -C /tmp/res "$mode"
