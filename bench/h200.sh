#!/usr/bin/env bash
# The H200 runs behind docs/performance.md, and the GPU tests; one stage per device call (each <= 10 min).
#
#   bash bench/h200.sh STAGE [STAGE ...]      from the source root on the GPU machine; results go to $OUT
#
# Stages:
#   setup       install the wheels in .whl/ into /tmp/site (the machine has torch, triton and transformers,
#               not the pure-Python dependencies) and put the SmolLM2 GGUF at $VERBATIM_GPU_GGUF
#               (joined from ~/gm/part-aa and .gpu/model-b/part-ab when it is not there)
#   mixes       the mode comparison on the synthetic 8B: the two ShareGPT-like mixes and 16 x 1k in / 256 out,
#               every mode                                          -> gpu-bench-modes-mixes.json
#   long4k      the same on 16 x 4k in / 1k out                    -> gpu-bench-modes-4k.json
#   core        decode step against the HBM floor, engine throughput, KV sizing (synthetic 8B)
#                                                                   -> gpu-bench-8b.json
#   replay      replay cost against generation (synthetic 8B)      -> gpu-replay.json
#   rollback    SmolLM2 rollback rates at W = 16 / 32 / 64          -> gpu-bench-rollback.json
#   probe       the batch-invariant GEMM at every tile shape: time and bitwise agreement
#                                                                   -> bi-matmul-probe.json
#   tests       every `gpu`-marked test of tests/engine             -> gpu-pytest.txt
#   dvrtests    the gpu tests of DVR bits under load, carried rows and overlap
#   packtests   the gpu tests of packed verify passes, carried rows and the engine's CUDA graphs
#   chaintests  the gpu tests of overlap and chained verify passes
#   tests1 / tests2   every `gpu`-marked test of tests/engine in two device calls (GPU_TESTS_1 lists the
#               first call's files, the second takes the rest)  -> gpu-pytest-1.txt, gpu-pytest-2.txt
#   sampler     the sampler alone and the SmolLM2 engine per sampling preset: bench/sampler_bench.py
#                                                                   -> sampler-bench.json
#   serve       the service through the API beside the engine alone, the synthetic 8B and SmolLM2:
#               bench/serve_bench.py                 -> serve-bench-8b.json / .png, serve-bench-smollm2.json / .png
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
GGUF=${VERBATIM_GPU_GGUF:-$HOME/gm/SmolLM2-135M-Instruct.Q4_1.gguf}
export VERBATIM_GPU_GGUF=$GGUF VERBATIM_GGUF=$GGUF
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

stage_setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING
  if [ ! -s "$GGUF" ] && [ -s ~/gm/part-aa ] && [ -s .gpu/model-b/part-ab ]; then
    cat ~/gm/part-aa .gpu/model-b/part-ab > "$GGUF"
  fi
  ls -la "$GGUF" || true
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
}

stage_mixes() {  # at most 290 s
  timeout "${MIXES_TIMEOUT:-290}" python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --deadline-s 280 --out "$OUT" \
    --name gpu-bench-modes-mixes ${MIXES_ARGS:-} 2>&1 | grep -v Warn | tail -20
}

stage_long4k() {  # at most 170 s
  timeout "${LONG4K_TIMEOUT:-170}" python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets 16x4096x1024 --modes nondeterministic,dvr_10pct,dvr_100pct,batch_invariant --deadline-s 160 \
    --out "$OUT" --name gpu-bench-modes-4k ${LONG4K_ARGS:-} 2>&1 | grep -v Warn | tail -8
}

stage_core() {
  timeout "${CORE_TIMEOUT:-540}" python3 -m engine bench --device cuda --sections core --out "$OUT" \
    --name gpu-bench-8b ${CORE_ARGS:-} 2>&1 | tail -60
}

stage_replay() {
  timeout "${REPLAY_TIMEOUT:-300}" python3 -m engine bench --replay --device cuda --out "$OUT" 2>&1 | tail -30
}

stage_rollback() {
  timeout "${ROLLBACK_TIMEOUT:-300}" python3 -m engine bench --device cuda --sections smollm2_rollback --gguf "$GGUF" \
    --out "$OUT" --name gpu-bench-rollback 2>&1 | tail -20
}

stage_probe() {
  timeout "${PROBE_TIMEOUT:-240}" python3 -m engine.bench_bi_matmul --out "$OUT" 2>&1 | tail -70
}

stage_tests() {
  timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/engine \
    2>&1 | tee "$OUT/gpu-pytest.txt" | tail -40
}

stage_dvrtests() {
  timeout "${DVRTESTS_TIMEOUT:-220}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/engine/test_gpu_dvr.py tests/engine/test_gpu_verify_carry.py tests/engine/test_gpu_overlap.py \
    2>&1 | tee "$OUT/gpu-pytest-dvr.txt" | tail -25
}

stage_packtests() {
  timeout "${PACKTESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -s \
    tests/engine/test_gpu_verify_packing.py tests/engine/test_gpu_verify_carry.py \
    tests/engine/test_gpu_engine_graphs.py 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-packing.txt" | tail -30
}

stage_chaintests() {
  timeout "${CHAINTESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -s \
    tests/engine/test_gpu_overlap.py 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-chained.txt" | tail -12
}

GPU_TESTS_1="tests/engine/test_sampler_triton.py tests/engine/test_gpu_engine_graphs.py
  tests/engine/test_gpu_verify_packing.py tests/engine/test_canonical_decode.py tests/engine/test_gpu_dvr.py
  tests/engine/test_gpu_overlap.py tests/engine/test_gpu_verify_carry.py"

stage_tests1() {
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=15 \
    $GPU_TESTS_1 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-1.txt" | tail -40
}

stage_tests2() {
  local skip=()
  for f in $GPU_TESTS_1; do skip+=(--ignore="$f"); done
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=15 \
    "${skip[@]}" tests/engine 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-2.txt" | tail -40
}

stage_sampler() {
  timeout "${SAMPLER_TIMEOUT:-240}" python3 bench/sampler_bench.py --out "$OUT" --gguf "$GGUF" 2>&1 \
    | grep -v Warn | tail -12
}

stage_serve() {  # issues 25 (item 3) and 26: the service through the API beside the engine alone, the synthetic 8B
  # and SmolLM2 (bench/serve_bench.py; at most 330 + 200 s, each run bounded by its --deadline-s). The copy on the
  # machine has no .git: GIT_COMMIT=$(git rev-parse HEAD) names the tree in the JSON.
  local commit=${GIT_COMMIT:+--git-commit $GIT_COMMIT}
  timeout "${SERVE_8B_TIMEOUT:-330}" python3 bench/serve_bench.py --model synthetic-8b --deadline-s 300 $commit \
    --out "$OUT" --name serve-bench-8b ${SERVE_ARGS:-} 2>&1 | grep -v Warn | tail -30
  timeout "${SERVE_SMOL_TIMEOUT:-200}" python3 bench/serve_bench.py --model "$GGUF" --quick --deadline-s 180 $commit \
    --out "$OUT" --name serve-bench-smollm2 ${SERVE_ARGS:-} 2>&1 | grep -v Warn | tail -30
}

for s in "$@"; do
  log "stage $s"
  "stage_$s"
  log "stage $s done"
done
