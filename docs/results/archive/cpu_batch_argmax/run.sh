#!/usr/bin/env bash
# CPU A/B of the batch rounds' argmax change: the tree before it (c21cebd) vs after (2fb51af's src), an A/A leg
# (after, again); a fresh process per leg and repetition, legs rotated per repetition.
OLD=/tmp/wt_old/src NEW=/work/main/src
for r in $(seq 0 9); do
  case $((r % 3)) in 0) order="old new aa";; 1) order="new aa old";; *) order="aa old new";; esac
  for leg in $order; do
    src=$NEW; [[ $leg == old ]] && src=$OLD
    echo "{\"rep\": $r, \"leg\": \"$leg\", \"run\": $(PYTHONPATH=$src python3 /tmp/ab_argmax.py 2>/dev/null | tail -1)}"
  done
done
