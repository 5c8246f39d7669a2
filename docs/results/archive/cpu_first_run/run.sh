#!/bin/bash
# the README's first command: cold (empty MLX cache) then warm, interleaved, default (CPU: untraced) vs traced
cd /work/main
out=/tmp/firstrun/times2.txt; : > $out
for mode in default traced; do rm -rf /tmp/firstrun/t2_$mode; mkdir -p /tmp/firstrun/t2_$mode; done
run() {  # mode rep
  local mode=$1 rep=$2 envs=""
  [ $mode = traced ] && envs="LATTICE_COMPILE=1 LATTICE_TRACE_STEPS=1 LATTICE_TRACE_ROUNDS=1"
  local s=$(date +%s.%N)
  env TMPDIR=/tmp/firstrun/t2_$mode $envs python3 -m lattice_mlx.generate --mtp --max-tokens 64 > /dev/null 2> /tmp/firstrun/e_${mode}_$rep
  local e=$(date +%s.%N)
  echo "$mode $rep $(echo "$e - $s" | bc) $(grep -o 'generation: [0-9.]* tok/s\|[0-9.]* tok/s' /tmp/firstrun/e_${mode}_$rep | tail -1)" >> $out
}
for rep in cold w1 w2 w3 w4 w5; do run default $rep; run traced $rep; done
