#!/usr/bin/env bash
# GPU measurements and checks for one device call each; results under $OUT as one tarball ($OUT returns few files).
# Usage (on the device machine, repo root, PYTHONPATH holding MLX's CUDA wheel and src/):
#   bash scripts/device/gpu_run.sh MODE [MODE ...]
# Modes, named by what they measure (knobs in CAPITALS, defaults in brackets):
#   suite          the whole test suite on the GPU: HALF=metal (tests/metal), rest (tests/ less tests/metal) or all (both side
#                  by side) [all]; each half fills a call (SUITE_WORKERS [14], SUITE_LIMIT s [540])
#   tests          TESTS (files or node ids) [tests], TEST_LIMIT s [480]; EACH=1: one pytest process per entry
#   doctor         python -m lattice_mlx.doctor on the demo and on config-only checkpoints of DOCTOR_SHAPES [0.8b 35b-a3b];
#                  KERNEL_CACHE_AB=1 instead: MLX's CUDA builds against LATTICE_KERNEL_CACHE's, bitwise, in 3 processes
#                  (kernel_cache_ab.py)
#   model-checks   kernels vs reference logits, forward cost over T, exact greedy MTP (gpu_model_checks.py)
#   invariance     whether verify rows are bitwise decode steps: 40 positions, whole oracle generations, a long
#                  (key-split) context (batch_invariance.py); INV_BATCH=B: also B sequences' verify against their
#                  plain steps, op by op (INV_DTYPE [float32], as the batch bench's MTP legs)
#   kernels        every kernel vs its plain-ops reference and MLX's built-ins (bench_kernels.py)
#   step-kernels   a decode step's kernels alone, CUPTI (bench_step_kernels.py); PER_FORWARD=1: kernels, GPU time,
#                  busy and span per forward over T = 1..8 instead (profile_kernels.py)
#   q4-fused       the fused 4-bit (SET=dense: unquantized) projections' GPU time by rows M, CUPTI (bench_q4_fused.py);
#                  MS [1,2,4,8], CAPACITIES [shared] (several: each case under each, the variant's rows held)
#   profile        where a decode step's wall time goes, op by op (profile_step.py)
#   host           a plain step's and a pipelined round's host time: Python graph building, MLX dispatch, waiting
#                  (round_host.py; HOST_K [3])
#   decode         one decode benchmark (python -m lattice_mlx.bench decode): SHAPE [the BIG shape, 0.8b; demo, 4b,
#                  27b, 35b-a3b], LEGS [stock,plain,plain-aa,pipelined], K [2,3], ORACLE_P [0.8; none: the real head],
#                  TEMPS [0], LENGTHS [16,96], REPS [10], EXTRA [more bench flags: --trace-ab, --head-q4-ab,
#                  --draft-vocab-ab 32768, --no-stock, --workloads code], PROFILE=1 for CUPTI, NAME, LIMIT s [300]
#   oracle         MTP speedup over the synthetic acceptance grid (0.8B shape)
#   spec-default   the default speculation vs plain and fixed K=1..4, whole generations, a process per group
#                  (spec_default.py): SD_MODEL [0.8b; demo], SD_DRAFTS [oracle:0..1 and head], SD_TEMPS [0],
#                  SD_LENGTHS [256], SD_LEGS [plain,plain-aa,default,k1..k4; default@SKIP=3;DWELL=4: the tuner's
#                  constants changed for that leg], REPS [10], NAME, LIMIT s [520],
#                  CAPACITY [shared; pow2, exact: the rows a matmul variant holds], PROFILE=1 for CUPTI per leg,
#                  SD_EXTRA: more of its flags (--warm-rounds 1, --machine-warmup 0),
#                  FIRST_USE=1: first_use.py before the groups (a prompt length's first prefill, the plain-to-rounds switch);
#                  OFF_STATE=1: off_state.py before them (the loop's off state vs plain decoding, variants, CUPTI),
#                  DEPTHS=1: each depth's first round (first_use.py --cases depths); FIRST_GEN=1: a user's first
#                  generation, a fresh process per leg (first_gen.py); SD_SKIP=1: those alone
#   batch          continuous batching vs mlx-lm's batch_generate, aggregate tok/s at STREAMS (batch_throughput.py,
#                  after its machine warm-up of the adaptive MTP leg's kinds of pass in a process of its own;
#                  BATCH_ARGS: more of its flags, e.g. --dequant-ab 9 --skip ours-untraced); KERNELS=1 first: the
#                  GDN kernel by rows per warp, MLX's 4-bit matmul by rows (bench_batch_kernels.py)
#   trees          tree vs chain drafts: 0.8B oracle and the demo head (bench_tree.py)
#   drafters       every draft source on the demo model (bench_drafters.py)
#   distributed    kind nvidia-h200-x2: the CLI under mlx.launch over NCCL, then per shape (DIST_SHAPES [4b 27b]) one
#                  GPU vs two (tensor, pipeline), plain and MTP at oracle 0.8 (bench_distributed.py)
#   peer           mlx-vlm's MTP and this project's legs on one checkpoint (carry .device-wheels/vlm); PROBE=1 only
#                  asks which of mlx-vlm's import-time dependencies the device's Python has
#   demo-train     the demo retrained on the package-split corpus (MTP_TARGET labels|distill|both), converted and
#                  measured (train_demo.py, distill_demo_head.py)
#   demo-head      the MTP head retrained alone on the shipped trunk, labels vs self-distillation (distill_demo_head.py)
# SAVE_PTX=1 after any modes: MLX's compiled-kernel cache back under $OUT (carry it next time as .device-ptx/).
# Each step is bounded by its own limit and by DEADLINE seconds for the whole call (default 540). The CUPTI modes
# need ../shared/device/gpu_kernels.py copied into .device-tools/ and carried. Scripts live beside this file's
# folder: scripts/bench/, scripts/demo/, scripts/device/.
set -u
export PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-540}
BIG=${BIG:-0.8b}  # a smaller shape (cpu-small, tiny) for a dry run on the CPU
RES=${RES:-/tmp/res}  # two runs side by side (one per GPU) take a folder and a TAR name each
mkdir -p "$RES"
# MLX's CUDA backend keeps every kernel it compiles (NVRTC) under MLX_PTX_CACHE_DIR (/tmp/mlx/<version>/ptx by
# default); a fresh machine compiles them all again: run 20's first process spent 139 s of device time on it, the
# next process 22 s. Mode save-ptx returns the cache under $OUT; a later session carries it back in .device-ptx/.
# (MLX's own default folder, so commands run outside this script on the same machine share the cache)
PTX=${MLX_PTX_CACHE_DIR:-/tmp/mlx/$(python3 -c "import mlx.core as mx; print(mx.__version__)" 2>/dev/null)/ptx}
export MLX_PTX_CACHE_DIR=$PTX && mkdir -p "$PTX"
if compgen -G ".device-ptx/ptx_cache.tgz*" > /dev/null; then
  cat .device-ptx/ptx_cache.tgz* | tar -xzf - -C "$PTX" && echo "PTX cache: $(ls "$PTX" | wc -l) files restored"
fi
LOCK=${LOCK:-/tmp/lattice_bench.lock}  # two runs side by side on two GPUs take a lock each
B=(python3 -m lattice_mlx.bench --lock "$LOCK")
step_kernels() {  # a decode step's kernels alone, CUPTI (scripts/bench/bench_step_kernels.py)
    step step_kernels 150 python3 scripts/bench/bench_step_kernels.py --profiler-dir .device-tools \
      --out "$RES/step_kernels.json"
    cat "$RES/step_kernels.out"
}
peer_probe() {  # whether mlx-vlm's MTP drafter could import here: it needs transformers, Pillow and scipy
    step peer_probe 60 python3 -c "import importlib.util as u; print({m: bool(u.find_spec(m)) for m in
      ('transformers', 'PIL', 'scipy', 'jinja2', 'sentencepiece', 'mlx_vlm')})"
    cat "$RES/peer_probe.out"
}
step() {  # step NAME LIMIT CMD...: one bounded process, logged under $RES, skipped past DEADLINE
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS)); ((left < limit)) && limit=$left
  if ((limit < 15)); then echo "$name: skipped (deadline)" | tee -a "$RES/steps.txt"; return; fi
  local t0=$SECONDS
  timeout --signal=INT --kill-after=5 "$limit" "$@" > "$RES/$name.out" 2> "$RES/$name.log"
  echo "$name: rc=$? in $((SECONDS - t0))s (limit $limit)" | tee -a "$RES/steps.txt"
}
suite_half() {  # suite_half NAME WORKERS LIMIT FILES...: one pytest process over FILES; NAME.out, NAME.summary
  # -v: each test's outcome is written as it ends, so a run cut by the limit still names its failures (run 15 lost
  # one: pytest names them only in its closing summary, which a cut run never prints)
  local name=$1 workers=$2 limit=$3; shift 3
  timeout --signal=INT --kill-after=20 "$limit" python3 -m pytest -v -n "$workers" -rfE --tb=line \
    -p no:cacheprovider "$@" > "$RES/$name.out" 2>&1; echo "rc=$?" >> "$RES/$name.out"
  { echo "== $name"; tail -n 4 "$RES/$name.out"
    echo "outcomes: $(grep -cE "^\[gw[0-9]+\] .*(PASSED|SKIPPED|FAILED|ERROR)" "$RES/$name.out")"
    grep -E "^(\[gw[0-9]+\] .*)?(FAILED|ERROR)" "$RES/$name.out" | head -n 30; } > "$RES/$name.summary"
}
for mode in "$@"; do
  case $mode in
  suite)
    case ${HALF:-all} in
    metal) suite_half suite_metal "${SUITE_WORKERS:-14}" "${SUITE_LIMIT:-540}" tests/metal ;;
    rest) suite_half suite_rest "${SUITE_WORKERS:-14}" "${SUITE_LIMIT:-540}" tests --ignore=tests/metal ;;
    *) suite_half suite_metal 4 "${SUITE_LIMIT:-500}" tests/metal &
       suite_half suite_rest 8 "${SUITE_LIMIT:-500}" tests --ignore=tests/metal
       wait ;;
    esac
    cat "$RES"/suite_*.summary | tee -a "$RES/steps.txt" ;;
  tests)
    if [[ ${EACH:-0} == 1 ]]; then  # one pytest process each, EACH_LIMIT seconds apiece
      n=0; for t in ${TESTS:?}; do
        step "test_$(basename "${t%%::*}" .py)_$((++n))" "${EACH_LIMIT:-60}" python3 -m pytest -q --tb=short \
          -p no:cacheprovider "$t"
      done
    else
      # shellcheck disable=SC2086
      step tests "${TEST_LIMIT:-480}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider ${TESTS:-tests}
      tail -n 30 "$RES/tests.out" > "$RES/tests.txt"; tail -n 5 "$RES/tests.txt"
    fi ;;
  doctor)  # python -m lattice_mlx.doctor on the demo, and on config-only checkpoints of the family's shapes
           # (DOCTOR_SHAPES, bf16 4-bit g64: the doctor reads config.json alone)
    if [[ ${KERNEL_CACHE_AB:-0} == 1 ]]; then  # MLX's own CUDA builds against the kept ones, 3 fresh processes
      rm -rf /tmp/ptx_ab0 /tmp/ptx_ab1
      step kc_ab0 200 env LATTICE_KERNEL_CACHE=0 MLX_PTX_CACHE_DIR=/tmp/ptx_ab0 \
        python3 scripts/device/kernel_cache_ab.py --save /tmp/kc0.npz
      for n in 1 2; do  # built here, then read from disk
        step "kc_ab$n" 120 env LATTICE_KERNEL_CACHE=1 MLX_PTX_CACHE_DIR=/tmp/ptx_ab1 \
          python3 scripts/device/kernel_cache_ab.py --save "/tmp/kc$n.npz"
      done
      step kc_ab 60 python3 scripts/device/kernel_cache_ab.py --compare /tmp/kc0.npz /tmp/kc1.npz /tmp/kc2.npz
      tail -n 8 "$RES/kc_ab.out"; continue
    fi
    step doctor_demo 120 python3 -m lattice_mlx.doctor --json "$RES/doctor_demo.json"
    for shape in ${DOCTOR_SHAPES:-0.8b 35b-a3b}; do
      python3 -c "import json, os, sys; from lattice_mlx.bench.synthetic import FAMILY; d = sys.argv[2]; os.makedirs(d,
        exist_ok=True); json.dump({'model_type': 'qwen3_5', 'text_config': {**FAMILY[sys.argv[1]], 'dtype':
        'bfloat16'}, 'quantization': {'bits': 4, 'group_size': 64}}, open(d + '/config.json', 'w'))" \
        "$shape" "/tmp/doctor_$shape"
      step "doctor_$shape" 150 python3 -m lattice_mlx.doctor --model "/tmp/doctor_$shape" \
        --json "$RES/doctor_$shape.json"
    done
    tail -n 3 "$RES"/doctor_*.out ;;
  model-checks) step model_checks 240 python3 scripts/device/gpu_model_checks.py --out "$RES/model_checks" ;;
  invariance)  # ~65 s + ~50 s + ~60 s on the H200 (run 6)
    step invariance_sweep 120 python3 scripts/bench/batch_invariance.py --model "$BIG" --ts 3 --sweep 40 --prompt 64 \
      --out "$RES/invariance_sweep"
    step invariance_loop 100 python3 scripts/bench/batch_invariance.py --model "$BIG" --ts "" --loop 3 --tokens 100 \
      --paths compiled --out "$RES/invariance_loop"
    step invariance_long 100 python3 scripts/bench/batch_invariance.py --model "$BIG" --ts 4 --sweep 8 --prompt 600 \
      --paths layers --out "$RES/invariance_long"
    if [[ -n ${INV_BATCH:-} ]]; then  # INV_BATCH=16: a batch's verify (16 x 4 rows) against its plain steps, op by op
      step invariance_batch 150 python3 scripts/bench/batch_invariance.py --model "$BIG" --dtype "${INV_DTYPE:-float32}" \
        --ts 4 --batch "$INV_BATCH" --prompt 64 --paths layers --out "$RES/invariance_batch"
      tail -n 20 "$RES/invariance_batch.out"
    fi ;;
  kernels) step kernels 240 python3 scripts/bench/bench_kernels.py --out "$RES/kernels.json" ;;
  step-kernels)
    if [[ ${PER_FORWARD:-0} == 1 ]]; then
      step kernels_per_forward 300 python3 scripts/bench/profile_kernels.py --out "$RES/kernels_per_forward"
    else step_kernels; fi ;;
  q4-fused) step q4_fused "${LIMIT:-200}" python3 scripts/bench/bench_q4_fused.py --profiler-dir .device-tools ${SET:+--set "$SET"} \
      ${MS:+--ms "$MS"} ${ONLY:+--only "$ONLY"} ${CAPACITIES:+--capacities "$CAPACITIES"} --out "$RES/q4_fused.json" ;;
  profile) step profile 300 python3 scripts/bench/profile_step.py --out "$RES/profile" --dtype bfloat16 ;;
  host)
    step round_host "${HOST_LIMIT:-240}" python3 scripts/bench/round_host.py --shape "$BIG" --k "${HOST_K:-3}" --steps 64 \
      --reps 3 --out "$RES/round_host.json" ;;
  decode)
    shape=${SHAPE:-$BIG} o=()
    [[ ${ORACLE_P:-0.8} != none && $shape != demo ]] && o=(--oracle-p "${ORACLE_P:-0.8}")
    [[ $shape != demo ]] && o+=(--dtype bfloat16)
    [[ ${PROFILE:-0} == 1 ]] && o+=(--profile .device-tools)
    # shellcheck disable=SC2086
    step "${NAME:-decode_$shape}" "${LIMIT:-300}" "${B[@]}" decode --model "$shape" --reps "${REPS:-10}" \
      --lengths "${LENGTHS:-16,96}" --temps "${TEMPS:-0}" --legs "${LEGS:-stock,plain,plain-aa,pipelined}" \
      --k "${K:-2,3}" "${o[@]}" ${EXTRA:-} --out "$RES/${NAME:-decode_$shape}" ;;
  oracle)
    step oracle_0.8b 200 "${B[@]}" oracle --model "$BIG" --dtype bfloat16 --reps 5 --lengths 16,96 \
      --oracle-ps 0,0.5,0.8,1 --k 2,3 --no-stock --out "$RES/oracle_0.8b" ;;
  spec-default)  # the default speculation against plain and fixed K=1..4, whole generations, a fresh process per
                 # group (spec_default.py): SD_MODEL [0.8b], SD_DRAFTS [oracle:0,oracle:0.3,oracle:0.5,oracle:0.8,
                 # oracle:1,head], SD_TEMPS [0], SD_LENGTHS [256], REPS [10], NAME, LIMIT s [520]
    if [[ ${OFF_STATE:-0} == 1 ]]; then  # first: the pipelined loop's off state vs plain decoding, with variants that
      # take one difference away each, CUPTI per leg (off_state.py), OFF_LIMIT s [150]
      # OFF_LEGS [all of off_state.py's], OFF_REPS [REPS]
      step off_state "${OFF_LIMIT:-150}" python3 scripts/bench/off_state.py --shape "$BIG" \
        --reps "${OFF_REPS:-${REPS:-10}}" ${OFF_LEGS:+--legs "$OFF_LEGS"} --profile .device-tools \
        --out "$RES/off_state.json"
      cat "$RES/off_state.out"
    fi
    if [[ ${FIRST_USE:-0} == 1 ]]; then  # first: a prompt length's first prefill (prompt attention in ops vs cuDNN)
      # and the switch from plain steps to rounds, per pass (first_use.py), FIRST_USE_LIMIT s [200]
      step first_use "${FIRST_USE_LIMIT:-200}" python3 scripts/bench/first_use.py --out "$RES/first_use"
      cat "$RES/first_use.out"
    fi
    if [[ ${DEPTHS:-0} == 1 ]]; then  # first: each depth's first traced round after plain steps, host build, wait and
      # builds, in two processes (first_use.py --cases depths), DEPTHS_LIMIT s [150]
      # DEPTH_PROCS: its processes, NAME[:MLX_SETTING=VALUE] each, api* with CUPTI's CUDA calls [0,1]
      step first_depths "${DEPTHS_LIMIT:-150}" python3 scripts/bench/first_use.py --cases depths \
        --switch-model "${DEPTHS_MODEL:-$BIG}" --depth-processes "${DEPTH_PROCS:-0,1}" --out "$RES/first_depths"
      cat "$RES/first_depths.out"
    fi
    if [[ ${FIRST_GEN:-0} == 1 ]]; then  # first: a user's first generation, a fresh process per leg and repetition
      # (plain, A/A, speculation="auto" with LATTICE_MTP=1; first_gen.py), FG_MODEL [demo: text prompts need a
      # tokenizer], SD_TEMPS, FG_TOKENS [256], REPS, FG_LEGS [plain,plain-aa,default; default@NAME=VALUE too],
      # FG_GENS [2: generations per process], PROFILE=1: one process per leg under CUPTI, FIRST_GEN_LIMIT s [300]
      step first_gen "${FIRST_GEN_LIMIT:-300}" python3 scripts/bench/first_gen.py --model "${FG_MODEL:-demo}" \
        --temps "${SD_TEMPS:-0}" --max-tokens "${FG_TOKENS:-256}" --reps "${REPS:-10}" \
        --legs "${FG_LEGS:-plain,plain-aa,default}" --gens "${FG_GENS:-2}" --out "$RES/first_gen.json" \
        $([[ ${PROFILE:-0} == 1 ]] && echo --profile .device-tools)
      cat "$RES/first_gen.out"
    fi
    [[ ${SD_SKIP:-0} == 1 ]] && continue  # SD_SKIP=1: only the steps above
    step "${NAME:-spec_default}" "${LIMIT:-520}" python3 scripts/bench/spec_default.py --model "${SD_MODEL:-$BIG}" \
      --drafts "${SD_DRAFTS:-oracle:0,oracle:0.3,oracle:0.5,oracle:0.8,oracle:1,head}" --temps "${SD_TEMPS:-0}" \
      --lengths "${SD_LENGTHS:-256}" --reps "${REPS:-10}" --legs "${SD_LEGS:-plain,plain-aa,default,k1,k2,k3,k4}" \
      ${CAPACITY:+--capacity "$CAPACITY"} $([[ ${PROFILE:-0} == 1 ]] && echo --profile .device-tools) ${SD_EXTRA:-} \
      --out "$RES/${NAME:-spec_default}.json"
    cat "$RES/${NAME:-spec_default}.out" ;;
  batch)  # continuous batching against mlx-lm's batch_generate, aggregate tok/s by streams (batch_throughput.py):
          # SHAPE [0.8b], STREAMS [1,4,16,64], TOKENS [128], REPS [10], PROFILE=1 for CUPTI per step, LIMIT s [400];
          # LOAD=1: then TTFT under Poisson arrivals (RATE [8]/s) through the server (server_load.py, the demo);
          # KERNELS=1: first a batch's GDN conv kernel by value rows per warp and MLX's 4-bit matmul by rows, CUPTI
          # (bench_batch_kernels.py, BS [1,4,16,64])
    if [[ ${KERNELS:-0} == 1 ]]; then
      step batch_kernels 200 python3 scripts/bench/bench_batch_kernels.py --profiler-dir .device-tools \
        --bs "${BS:-1,4,16,64}" --out "$RES/batch_kernels.json"
      cat "$RES/batch_kernels.out"
    fi
    step "${NAME:-batch_${SHAPE:-$BIG}}" "${LIMIT:-400}" python3 scripts/bench/batch_throughput.py --model "${SHAPE:-$BIG}" \
      --streams "${STREAMS:-1,4,16,64}" --tokens "${TOKENS:-128}" --reps "${REPS:-10}" \
      $([[ ${PROFILE:-0} == 1 ]] && echo --profile .device-tools) ${BATCH_ARGS:-} --out "$RES/${NAME:-batch_${SHAPE:-$BIG}}.json"
    cat "$RES/${NAME:-batch_${SHAPE:-$BIG}}.out"
    if [[ ${LOAD:-0} == 1 ]]; then  # TTFT under Poisson arrivals through the server, --max-batch 1 vs MAX_BATCH
      step server_load "${LOAD_LIMIT:-200}" python3 scripts/bench/server_load.py --rate "${RATE:-8}" --seconds 30 \
        --tokens 64 --max-batch "1,${MAX_BATCH:-16}" --server-args "--dtype bfloat16" --out "$RES/server_load.json"
      cat "$RES/server_load.out"
    fi ;;
  trees)
    step trees_0.8b 180 python3 scripts/bench/bench_tree.py --out "$RES/trees_0.8b" --model "$BIG" --oracle-p 0.8 --prompts 3
    step trees_demo 90 python3 scripts/bench/bench_tree.py --out "$RES/trees_demo" --prompts 6 --tokens 48 ;;
  drafters) step drafters 90 python3 scripts/bench/bench_drafters.py --out "$RES/drafters" --prompts 6 --tokens 64 ;;
  distributed)
    # mlx.launch from the wheel (no console script there); NVLink multicast stays off in every rank (KINDS.md).
    # mlx.launch exits 0 even when a rank fails, so each multi-process step is judged by its ranks' JSON files.
    L=(python3 -c 'import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = "mlx.launch"; sys.exit(main())'
       -n 2 --backend "${DIST_BACKEND:-nccl}" --env "PYTHONPATH=${PYTHONPATH:-}" --env PYTHONUNBUFFERED=1 --env NCCL_NVLS_ENABLE=0
       --env TORCH_SYMM_MEM_DISABLE_MULTICAST=1 --env NVSHMEM_DISABLE_NVLS=1)
    D=(python3 scripts/bench/bench_distributed.py --reps "${REPS:-10}" --lengths "${DIST_LENGTHS:-16,48}"
       --lock "$LOCK" --k "${DIST_K:-2}")
    [[ ${NOPROF:-0} == 1 ]] || D+=(--profile .device-tools)
    ranks_wrote() {  # ranks_wrote NAME DIR: a line in steps.txt when a rank wrote no JSON (it failed)
      local r
      for r in 0 1; do
        [[ -f $2/rank$r.json ]] || echo "$1: FAILED: rank $r wrote no JSON (see $1.log)" | tee -a "$RES/steps.txt"
      done
    }
    # DIST_CLI: 1 = the CLI tensor-parallel and pipeline runs, 0 = neither, pipeline = the pipeline run only
    [[ ${DIST_CLI:-1} == 1 ]] && step dist_cli 90 "${L[@]}" python3 -m lattice_mlx.generate --prompt "def add(a, b):" \
      --max-tokens 32 --mtp
    for shape in ${DIST_SHAPES:-4b 27b}; do
      ck=/tmp/ckpt_$shape lim=()
      [[ $shape == 27b ]] && lim=(--memory-limit-gb 12)
      if [[ " ${DIST_MODES:-single tensor pipeline} " == *" single "* ]]; then
        step "dist_${shape}_single" "${DIST_LIMIT:-200}" env CUDA_VISIBLE_DEVICES=0 "${D[@]}" --shape "$shape" --mode single --save "$ck" \
          --out "$RES/dist_${shape}_single"
      fi
      src=()  # the saved checkpoint (renamed into place once whole) read rank by rank, else the lazy random model
      [[ -f $ck/config.json ]] && src=(--load "$ck")
      for split in ${DIST_MODES:-single tensor pipeline}; do
        [[ $split == single ]] && continue
        # DIST_MODES may hold tensor-mtp: tensor parallel with the MTP head's layer sharded too (--mtp sharded)
        mode=$split mtp=replicated
        [[ $split == tensor-mtp ]] && mode=tensor mtp=sharded
        name="dist_${shape}_${mode}_mtp_$mtp"
        step "$name" "${DIST_LIMIT:-200}" "${L[@]}" "${D[@]}" --shape "$shape" --mode "$mode" --dist-backend "${DIST_BACKEND:-nccl}" \
          --mtp "$mtp" "${src[@]}" "${lim[@]}" --out "$RES/$name"
        ranks_wrote "$name" "$RES/$name"
      done
      if [[ $shape == 27b && -f $ck/config.json ]]; then  # the whole model loaded once under the ranks' limit
        step dist_27b_whole_limit 90 env CUDA_VISIBLE_DEVICES=0 "${D[@]}" --shape 27b --mode single --load "$ck" \
          "${lim[@]}" --build-only --out "$RES/dist_27b_whole_limit"
      fi
    done
    [[ ${DIST_CLI:-1} == 1 || ${DIST_CLI:-1} == pipeline ]] && step dist_cli_pipeline 90 "${L[@]}" python3 -m lattice_mlx.generate \
      --prompt "def add(a, b):" --max-tokens 32 --mtp --pipeline
    ;;
  peer)  # mlx-vlm 0.7.10's native MTP beside this project's legs on one random hub-layout checkpoint
         # (scripts/bench/peer_mlx_vlm.py); its wheel travels in .device-wheels/vlm and is installed with MLX's
    if [[ ${PROBE:-0} == 1 ]]; then peer_probe; continue; fi
    step peer "${PEER_LIMIT:-300}" python3 scripts/bench/peer_mlx_vlm.py --shape "$BIG" --dir /tmp/peer --k "${PEER_K:-3}" \
      --reps "${REPS:-10}" --prompts 2 --tokens 16,64 --dtype bfloat16 --lattice --out "$RES/peer_mlx_vlm.json"
    tail -n 5 "$RES/peer.log" ;;
  demo-train)  # [demo-head]: the package-split corpus built on the device, the demo retrained with MTP_TARGET
    # (labels, distill or both) for TRAIN_SECONDS on TRAIN_BYTES of text, converted to the shipped form (4-bit trunk,
    # bf16 head) and measured (held-out loss, MTP acceptance); needs torch, transformers, tokenizers, safetensors
    # there. The bf16 checkpoint stays on the device (the results carry the 4-bit one and the training log).
    t=${MTP_TARGET:-distill} w=/tmp/demo_${MTP_TARGET:-distill}
    [[ -f /tmp/corpus/train.txt ]] || step corpus 90 python3 scripts/demo/build_corpus.py --out /tmp/corpus
    [[ ${SHIPPED_LOSS:-0} == 1 ]] && step demo_eval_shipped 90 python3 scripts/demo/distill_demo_head.py --eval-only --loss \
      --heldout-text /tmp/corpus/heldout.txt --eval-prompts 0 --out "$RES/eval_shipped"
    cp /tmp/corpus/summary.json "$RES/corpus_summary.json" 2>/dev/null
    step demo_train_"$t" 560 python3 scripts/demo/train_demo.py --corpus-out /tmp/corpus --out-dir "$w" --mtp-target "$t" \
      --train-seconds "${TRAIN_SECONDS:-300}" --max-train-bytes "${TRAIN_BYTES:-200000000}" \
      --tokenizer-bytes "${TOKENIZER_BYTES:-40000000}" --deadline-seconds "$((DEADLINE - SECONDS - 70))"
    cp "$w"/train_log.json "$w"/loss_curve.png "$RES/" 2>/dev/null
    step demo_convert_"$t" 40 python3 -m lattice_mlx.convert --hf-path "$w/hf" --mlx-path "$RES/mlx_$t" -q \
      --q-group-size 64 --dtype float32
    step demo_eval_"$t" 120 python3 scripts/demo/distill_demo_head.py --model "$RES/mlx_$t" --eval-only --loss \
      --heldout-text /tmp/corpus/heldout.txt --eval-prompts 16 --out "$RES/eval_$t" ;;
  demo-head)  # [demo-head]: the MTP head retrained alone on the shipped 4-bit trunk or HEAD_MODEL's (starting from its
    # head), labels vs self-distillation (MLX, no torch), each measured through the real greedy loop on both held-out
    # prompt sets; HEAD_TARGETS picks targets, DEPTH_WEIGHTS trains drafts 2..K through the head's recursion too,
    # HEAD_CORPUS trains on a build_corpus.py folder's train.txt (built here when it is /tmp/corpus and missing)
    hm=() hc=()
    [[ -n ${HEAD_MODEL:-} ]] && hm=(--model "$HEAD_MODEL")
    if [[ -n ${HEAD_CORPUS:-} ]]; then
      [[ -f $HEAD_CORPUS/train.txt ]] || step corpus 90 python3 scripts/demo/build_corpus.py --out "$HEAD_CORPUS"
      hc=(--corpus "$HEAD_CORPUS")
    fi
    for t in ${HEAD_TARGETS:-labels distill}; do
      step "head_$t" "${HEAD_LIMIT:-280}" python3 scripts/demo/distill_demo_head.py --target "$t" "${hm[@]}" "${hc[@]}" \
        --seconds "${HEAD_SECONDS:-150}" --batch 32 --depth-weights "${DEPTH_WEIGHTS:-1}" --out "$RES/head_$t"
    done ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done
if [[ ${SAVE_PTX:-0} == 1 ]]; then  # the kernel cache as $OUT/ptx_cache.tgz.part_* (15 MB each: $OUT returns files of <= 16 MiB)
  tar -czf - -C "$PTX" . | split -b 15m - "${OUT:-/tmp}/ptx_cache.tgz.part_"
  ls -la "${OUT:-/tmp}"/ptx_cache.tgz.part_*
fi
cat "$RES/steps.txt"
tar -czf "${OUT:-/tmp}/${TAR:-results}.tgz" -C "$RES" .
