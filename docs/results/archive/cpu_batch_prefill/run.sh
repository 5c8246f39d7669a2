#!/usr/bin/env bash
# The CPU A/B of LATTICE_BATCH_PREFILL (ab_prefill.py): legs rotated per repetition, a fresh process each, an A/A leg
# (`off-aa`: the setting off again). Appends to runs.jsonl; summ.py prints the paired ratios.
set -eu
cd "$(dirname "$0")"
REPS=${REPS:-12}
for rep in $(seq 0 $((REPS - 1))); do
  legs=(off on off-aa)
  for i in 0 1 2; do
    leg=${legs[$(((i + rep) % 3))]}
    case $leg in on) v=1 ;; *) v=0 ;; esac
    LATTICE_BATCH_PREFILL=$v python3 ab_prefill.py "$leg" "$rep" >> runs.jsonl
  done
done
python3 summ.py
