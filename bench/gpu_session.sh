#!/usr/bin/env bash
# The standard GPU measurements, one stage a device call (each fits 10 minutes on an H200), in the
# order a session with 30 minutes of device time takes them. Every stage writes under $OUT (or
# ./gpu-out) and prints a short table last. Run from the repository root on the GPU machine;
# without a stage, it prints the stages (from the table below).
set -euo pipefail
cd "$(dirname "$0")/.."

# The stages, in session order: name, then what it runs and for how long (the usage text), then its
# commands, which run in this shell ($out: the output folder; `run`: a command through bench/gpu.sh).
STAGES=(first tune step step-in-step e2e-b4 e2e-b1 e2e-adaptive short compile compile-profile static-launcher compile-once lossless lossless-b8 workload tests)
declare -A ABOUT COMMANDS

ABOUT[first]="~10 min: for a session that may get one call, stage static-launcher (the CUDA-graph GPU tests with it on, lossless rounds included; the 32-layer dense and prism-g4 cold compiles and restarts) then compile-profile at 4 layers"
COMMANDS[first]='
  eval "${COMMANDS[static-launcher]}"
  profile_layers=4 eval "${COMMANDS[compile-profile]}"'

ABOUT[tune]="~6 min: GPU op tests, then kernel_tuning (INT2 variants, row vs passes) against .scratch/base/oldlowering"
COMMANDS[tune]='
  run python3 -P -m pytest -q -m gpu tests/ops/test_op_select.py tests/ops/test_op_mass.py tests/ops/test_op_attention.py \
    tests/ops/test_op_int2.py > "$out/op_tests.log" 2>&1 || echo "GPU op tests FAILED (the tuning runs anyway)"
  tail -5 "$out/op_tests.log"
  base=()
  [ -d .scratch/base/oldlowering ] && base=(--baseline .scratch/base)
  run python3 bench/kernel_tuning.py --only int2 select mass --contexts 131072 32768 "${base[@]}" --out "$out" \
    2>&1 | tee "$out/tuning.log" | tail -14'

ABOUT[step]="~3 min: the kernel roofline twice (bench/kernel_step.py), and the adaptive budget at a sharpness that lets it trim"
COMMANDS[step]='
  run python3 bench/kernel_step.py --repeat 2 --short --plans hash prism-g4 prism-g4-hash prism-g4-int2refine \
    --out "$out" | tail -12
  run python3 bench/kernel_step.py --repeat 2 --contexts 131072 --batches 1 16 --plans prism-g4 prism-g4-mass0.95 \
    --sharpness 3.25 --out "$out" | tail -4'

ABOUT[step-in-step]="~7 min: dense attention's kernels inside the compiled step (bench/profile_step.py, dense-gqa, 8 layers) at 128K x 1 / 4 and 64K x 8, then the kernel table with each plan's ratio against them (kernel_step.py --dense-in-step)"
COMMANDS[step-in-step]='
  for shape in 131072x1 131072x4 65536x8; do
    run python3 bench/profile_step.py --layers 8 --context ${shape%x*} --batch ${shape#*x} --methods dense-gqa \
      --out "$out/profile-$shape" 2>&1 | tail -2
  done
  run python3 bench/kernel_step.py --contexts 131072 65536 --batches 1 4 8 --plans hash prism-g4 \
    --dense-in-step "$out"/profile-*/profile-step-*.json --out "$out" | tail -12'

ABOUT[e2e-b4]="~8 min: end to end at 128K, batch 4: dense, hash, prism-g4, prism-g4-hash"
COMMANDS[e2e-b4]='
  run python3 bench/decode_speed.py --shapes 131072x4 --methods dense-gqa,hash,prism-g4,prism-g4-hash \
    --repeat 2 --out "$out" 2>&1 | tail -10'

ABOUT[e2e-b1]="~8 min: the same at batch 1 (a cold compile takes 100-130 s a plan, so a stage holds dense and three plans at most)"
COMMANDS[e2e-b1]='
  run python3 bench/decode_speed.py --shapes 131072x1 --methods dense-gqa,hash,prism-g4,prism-g4-hash \
    --repeat 2 --out "$out" 2>&1 | tail -10'

ABOUT[e2e-adaptive]="~7 min: dense and prism-g4-mass0.95 at batch 1 and 4"
COMMANDS[e2e-adaptive]='
  run python3 bench/decode_speed.py --shapes 131072x1,131072x4 --methods dense-gqa,prism-g4-mass0.95 --repeat 2 \
    --out "$out" 2>&1 | tail -8'

ABOUT[short]="~8 min: caches short of the break-even, min_context 'auto' (dense kept) against 0 (sparse forced): 32K batch 1, 16K batch 4"
COMMANDS[short]='
  for mc in auto 0; do
    run python3 bench/decode_speed.py --shapes 32768x1,16384x4 --methods dense-gqa,prism-g4 --min-context $mc \
      --repeat 2 --out "$out/min-context-$mc" 2>&1 | tail -6
  done'

ABOUT[compile]="~9 min: cold compile time by phase, then a restart on the same caches and one from the portable artifacts (bench/compile_time.py --restart)"
COMMANDS[compile]='
  run python3 bench/compile_time.py --plans dense hash prism-g4 --layers 32 --restart --out "$out" 2>&1 | tail -12'

ABOUT[compile-profile]="~4 min: cold compiles of dense and prism-g4 (16 layers) under cProfile (bench/compile_time.py --profile): where the excess AOT metadata, scheduling and module load go"
COMMANDS[compile-profile]='
  run python3 bench/compile_time.py --plans dense prism-g4 --layers "${profile_layers:-16}" --profile --out "$out/profile" \
    2>&1 | tail -6'

ABOUT[static-launcher]="~9 min: Inductor's static CUDA launcher on (sparse_fx.backend.STATIC_LAUNCHER): the CUDA-graph tests under it, then prism-g4's cold compile and restarts with it, dense's beside them"
COMMANDS[static-launcher]='
  run python3 -P -c "import sys, pytest, sparse_fx.backend as b; b.STATIC_LAUNCHER = True; sys.exit(pytest.main([\"-q\", \"-x\", \"tests/generate/test_gpu.py\", \"-k\", \"inductor or graphs or lossless\"]))" 2>&1 | tail -4
  run python3 bench/compile_time.py --plans dense prism-g4 --layers 32 --restart --static-launcher --out "$out" 2>&1 | tail -8'

ABOUT[compile-once]="~8 min: one decode graph for every cache length (bench/cache_lengths.py, hash and prism-g4, batch 1; hash batch 4), the step against graphs with the length fixed at 32K and 128K, and the GPU test of it"
COMMANDS[compile-once]='
  run python3 bench/cache_lengths.py --plans hash prism-g4 --lengths 32768,49152,98304,131072 --out "$out" 2>&1 | tail -12
  run python3 bench/cache_lengths.py --plans hash --lengths 32768,131072 --batch 4 --out "$out/b4" 2>&1 | tail -6
  run python3 bench/cache_lengths.py --plans hash --lengths 32768,131072 --static --out "$out/static" 2>&1 | tail -6
  run python3 -P -m pytest -q tests/generate/test_gpu.py -k every_cache_length 2>&1 | tail -3'

ABOUT[lossless]="~8 min: the verify step's attention against SDPA (one layer), then lossless mode (prism-g4 drafts, gamma 4 and 8) against dense and the lossy plan, 16 layers of the 8B shape, 32K / 64K / 128K x batch 1 and 4"
COMMANDS[lossless]='
  run python3 bench/verify_attention.py --out "$out" 2>&1 | tail -8
  run python3 bench/lossless_speed.py --shapes 131072x4,65536x4,32768x4,131072x1,65536x1,32768x1 --layers 16 \
    --plans prism-g4 --gammas 4,8 --acceptance bench/results/lossless-acceptance-2026-12-07-cpu-fp32.json \
    --out "$out" 2>&1 | tail -12'

ABOUT[lossless-b8]="~8 min: lossless mode at batch 8 and 16 (prism-g4 and hash drafts, gamma 4): 64K x 8, 32K x 8, 32K x 16"
COMMANDS[lossless-b8]='
  run python3 bench/lossless_speed.py --shapes 65536x8,32768x8,32768x16 --layers 16 --plans prism-g4,hash \
    --acceptance bench/results/lossless-acceptance-2026-12-07-cpu-fp32.json --out "$out" 2>&1 | tail -12'

ABOUT[workload]="~9 min: a stream of 6 requests (8K-64K prompts, 64-256 new tokens) through generate() at batch 1: Hugging Face's static-cache compile, dense-gqa, hash; generate() per token against the tight loop"
COMMANDS[workload]='
  run python3 bench/workload.py --methods hf-static,dense-gqa,hash --requests 6 --max-context 65536 --new 64,256 \
    --batches 1 --out "$out" 2>&1 | tail -14'

ABOUT[tests]="~9 min: tests/generate/test_gpu.py"
COMMANDS[tests]='
  run python3 -P -m pytest -q tests/generate/test_gpu.py 2>&1 | tee "$out/test_gpu.log" | tail -15'

usage() {
  echo "Usage, from the repository root on the GPU machine: bash bench/gpu_session.sh STAGE"
  echo "(one stage a device call; results under \$OUT, default ./gpu-out)"
  echo
  for stage in "${STAGES[@]}"; do
    printf '  %-13s %s\n' "$stage" "${ABOUT[$stage]}"
  done
  echo
  echo "tune needs the older lowering package to A/B against, made here before the call and carried:"
  echo "  mkdir -p .scratch/base && git archive <rev> lowering | tar -x -C .scratch/base &&"
  echo "  mv .scratch/base/lowering .scratch/base/oldlowering && : > .scratch/base/oldlowering/__init__.py"
  echo "(run with carry=[\".scratch\"]; .git/info/exclude ignores /.scratch/)."
}

stage=${1:-}
if [ -z "$stage" ] || [ -z "${COMMANDS[$stage]+set}" ]; then
  usage
  exit 2
fi
out=${OUT:-gpu-out}
mkdir -p "$out"
run() { bash bench/gpu.sh "$@"; }
eval "${COMMANDS[$stage]}"
