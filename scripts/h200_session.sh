#!/usr/bin/env bash
# One device call's worth of GPU checks, results under $OUT (one tarball, since $OUT returns few files).
# Usage (device machine, repo root, PYTHONPATH set): bash scripts/h200_session.sh tests|profile|bench
set -u
export PYTHONUNBUFFERED=1
mode=$1
R=/tmp/res/$mode
mkdir -p "$R"
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
esac
tar -czf "$OUT/$mode.tgz" -C /tmp/res "$mode"
