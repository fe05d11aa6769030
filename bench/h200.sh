#!/usr/bin/env bash
# The GPU runs behind the README's H200 figures, one stage per device call (each call <= 10 min).
#
#   bench/h200.sh STAGE [STAGE ...]      run from the source root on the GPU machine; results go to $OUT
#
# Stages: setup (wheels from .whl/, SmolLM2 GGUF from ~/gm parts), tests (every `gpu`-marked test),
# core (issue 5 benchmark on the synthetic 8B), replay (issue 4), bi (batch-invariant numerics breakdown),
# probe (batch-invariant GEMM tile shapes), modes (issue 6 comparison on the 8B
# and SmolLM2, SmolLM2 rollback rates), sweep (W/G sweep), long (the 4k-in/1k-out set), canonical (what a
# decode step pays for canonical DVR rows: bench/canonical_step_probe.py), step (GEMM / decode / verify kernel
# breakdown and verify beside decode on two streams: bench/step_probe.py;
# STEP_ARGS=--only-split-sweep: the decode step at batch 16/32/64 per split-KV split size), levers (the
# mixes with --concurrent-carried on and the 4k set with --prefill-pass-tile 64: the switches built off),
# vprobe (the canonical decode kernel's programs per launch: bench/verify_probe.py), mixes (the two mixes and
# the 1k set at main's defaults, every mode), dvrtests (gpu tests of DVR bits: test_gpu_dvr, _verify_carry, _overlap),
# levers13 (the thirteenth session's open A/Bs: speculative early decode on/off, 2048-token canonical passes on the 1k set),
# levers14 (chained verify passes off/on with the early decode on; both with 2048-token canonical passes),
# levers15 (verify passes padded / packed, early decode on), packtests (gpu tests of packed verify passes),
# levers16 (packed passes at other W / G / D and with 2048-token canonical passes), levers17 (packed, 2048, D = 64 / 96 / 128),
# final16 (the mixes, the 1k and the 4k set at the sixteenth session's CUDA defaults),
# levers18 (packed passes due at G*W tokens against G windows), profile17 (the mixes' GPU gaps, nondeterministic
# and dvr 100 %, at the sixteenth session's defaults), levers19 (chained verify passes off / on: windows may end at
# in-flight tokens), chaintests (gpu tests of test_gpu_overlap.py, chained verify among them), final17 / final17long
# (the seventeenth session's figures at main's CUDA defaults).
# The machine has torch/triton/transformers but not our pure-Python deps: see ../shared/GPU.md and
# ../shared/tools/gpu-prep for how the wheels and the model parts get there.
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

stage_tests() {
  timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/engine \
    2>&1 | tee "$OUT/gpu-pytest.txt" | tail -40
}

stage_core() {
  timeout "${CORE_TIMEOUT:-540}" python3 -m engine bench --device cuda --sections core --out "$OUT" \
    --name gpu-bench-8b ${CORE_ARGS:-} 2>&1 | tail -60
}

stage_replay() {
  timeout "${REPLAY_TIMEOUT:-300}" python3 -m engine bench --replay --device cuda --out "$OUT" 2>&1 | tail -30
}

stage_modes() {
  timeout "${MODES_TIMEOUT:-540}" python3 -m engine bench --device cuda --sections modes --gguf "$GGUF" \
    --out "$OUT" --name gpu-bench-modes ${MODES_ARGS:-} 2>&1 | tail -60
}

stage_sweep() {
  timeout "${SWEEP_TIMEOUT:-540}" python3 -m engine bench --device cuda --sections sweep --gguf "$GGUF" \
    --out "$OUT" --name gpu-bench-sweep ${SWEEP_ARGS:-} 2>&1 | tail -40
}

stage_bi() {
  timeout "${BI_TIMEOUT:-300}" python3 -m engine bench --device cuda --sections bi --out "$OUT" \
    --name gpu-bench-bi 2>&1 | tail -40
}

stage_probe() {
  timeout "${PROBE_TIMEOUT:-240}" python3 -m engine.bench_bi_matmul --out "$OUT" 2>&1 | tail -70
}

stage_long() {
  timeout "${LONG_TIMEOUT:-540}" python3 -m engine bench --device cuda --sections long --out "$OUT" \
    --name gpu-bench-long ${LONG_ARGS:-} 2>&1 | tail -40
}

stage_step() {
  timeout "${STEP_TIMEOUT:-240}" python3 bench/step_probe.py --out "$OUT" ${STEP_ARGS:-} 2>&1 | grep -v Warn | tail -14
}

stage_vprobe() {  # the canonical decode kernel's grid: verify pass with carried rows, canonical decode step
  timeout "${VPROBE_TIMEOUT:-200}" python3 bench/verify_probe.py --out "$OUT" ${VPROBE_ARGS:-} 2>&1 | grep -v Warn | tail -20
}

stage_levers() {  # the eleventh session's switches that are off, each beside main's defaults (stage modes / long)
  timeout "${LEVERS_TIMEOUT:-250}" python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets sharegpt,sharegpt-896x640 --deadline-s 200 --concurrent-carried on --out "$OUT" \
    --name gpu-bench-modes-mixes-concurrent-carried 2>&1 | tail -25
  timeout "${LEVERS_TIMEOUT:-300}" python3 -m engine bench --device cuda --sections long --prefill-pass-tile 64 \
    --out "$OUT" --name gpu-bench-long-prefill64 2>&1 | tail -25
}

stage_mixes() {  # issue 6's mixes and the 1k set at main's defaults, every mode (thirteenth session)
  timeout "${MIXES_TIMEOUT:-300}" python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --deadline-s 285 --out "$OUT" \
    --name gpu-bench-modes-mixes ${MIXES_ARGS:-} 2>&1 | grep -v Warn | tail -30
}

stage_dvrtests() {  # the gpu tests of DVR bits under overlap, carried rows and load (SmolLM2 and the 8B heads)
  timeout "${DVRTESTS_TIMEOUT:-220}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/engine/test_gpu_dvr.py tests/engine/test_gpu_verify_carry.py tests/engine/test_gpu_overlap.py \
    2>&1 | tee "$OUT/gpu-pytest-dvr.txt" | tail -25
}

stage_levers13() {  # the thirteenth session's open A/Bs, each pair on one machine (at most 560 s, under one
  # device call's 600 s): the speculative early decode
  # on against off (mixes and the 1k set), then 2048-token canonical prefill passes against the budget (1k set)
  for ed in off on; do
    timeout 180 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --modes nondeterministic,dvr_10pct,dvr_100pct \
      --verify-early-decode $ed --deadline-s 170 --out "$OUT" --name gpu-bench-early-decode-$ed 2>&1 | grep -v Warn | tail -12
  done
  for p in 8192 2048; do
    timeout 100 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets 16x1024x256 --modes nondeterministic,dvr_100pct --canonical-prefill-min-tokens $p \
      --deadline-s 90 --out "$OUT" --name gpu-bench-1k-p$p 2>&1 | grep -v Warn | tail -6
  done
}

stage_levers14() {  # the fourteenth session's A/B, one machine (at most 3 x 175 s): chained verify passes off / on with
  # the early decode on, then both on with 2048-token canonical prefill passes
  for cfg in "off 8192" "on 8192" "on 2048"; do
    set -- $cfg
    timeout 175 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --modes nondeterministic,dvr_50pct,dvr_100pct \
      --verify-early-decode on --chained-verify $1 --canonical-prefill-min-tokens $2 --deadline-s 165 --out "$OUT" \
      --name gpu-bench-chained-$1-p$2 2>&1 | grep -v Warn | tail -8
  done
}

stage_levers15() {  # the sixteenth session's A/B, one machine (at most 2 x 175 s): verify passes padded / packed,
  # early decode on, 8192-token canonical passes
  for pk in padded packed; do
    timeout 175 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --modes nondeterministic,dvr_10pct,dvr_100pct \
      --verify-early-decode on --verify-packing $pk --deadline-s 165 --out "$OUT" \
      --name gpu-bench-verify-$pk 2>&1 | grep -v Warn | tail -8
  done
}

stage_levers16() {  # the sixteenth session's second A/B, one machine (at most 5 x 110 s): packed verify passes at
  # G = 8 (main's), G = 16 with D = 64 / 128, W = 16 with G = 16, and G = 8 with 2048-token canonical passes
  for cfg in "32 8 64 8192" "32 16 64 8192" "32 16 128 8192" "16 16 64 8192" "32 8 64 2048"; do
    set -- $cfg
    timeout 110 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets sharegpt,sharegpt-896x640 --modes nondeterministic,dvr_100pct \
      --verify-early-decode on --verify-packing packed --window $1 --group $2 --verify-decode-rows $3 \
      --canonical-prefill-min-tokens $4 --deadline-s 100 --out "$OUT" \
      --name gpu-bench-packed-w$1-g$2-d$3-p$4 2>&1 | grep -v Warn | tail -4
  done
}

stage_levers17() {  # the sixteenth session's third A/B, one machine (at most 3 x 110 s): packed passes with
  # 2048-token canonical passes carrying D = 64 / 96 / 128 decode rows
  for d in 64 96 128; do
    timeout 110 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets sharegpt,sharegpt-896x640 --modes nondeterministic,dvr_100pct \
      --verify-early-decode on --verify-packing packed --verify-decode-rows $d \
      --canonical-prefill-min-tokens 2048 --deadline-s 100 --out "$OUT" \
      --name gpu-bench-packed-p2048-d$d 2>&1 | grep -v Warn | tail -4
  done
}

stage_final16() {  # the sixteenth session's figures at main's new CUDA defaults (packed verify passes, 2048-token
  # canonical passes, early decode): the mixes and the 1k set in every mode, then the 4k set (at most 290 + 170 s)
  timeout 290 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --deadline-s 280 --out "$OUT" \
    --name gpu-bench-modes-mixes 2>&1 | grep -v Warn | tail -20
  timeout 170 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets 16x4096x1024 --modes nondeterministic,dvr_10pct,dvr_100pct --deadline-s 160 \
    --out "$OUT" --name gpu-bench-modes-4k 2>&1 | grep -v Warn | tail -6
}

stage_levers18() {  # for the next session, one machine (at most 2 x 130 s): packed passes due at G*W tokens of
  # windows (main's default) against due at G windows (verify_trigger="windows", built in the sixteenth session)
  for t in tokens windows; do
    timeout 130 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets sharegpt,sharegpt-896x640 --modes nondeterministic,dvr_50pct,dvr_100pct \
      --verify-trigger $t --deadline-s 120 --out "$OUT" --name gpu-bench-trigger-$t 2>&1 | grep -v Warn | tail -6
  done
}

stage_profile17() {  # where the GPU idles at the sixteenth session's defaults: the mixes, nondeterministic and
  # dvr 100 %, each with one more run under torch.profiler (gaps by neighbouring kernels)
  timeout "${PROFILE_TIMEOUT:-240}" python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets sharegpt,sharegpt-896x640 --modes nondeterministic,dvr_100pct \
    --profile-modes nondeterministic,dvr_100pct --deadline-s 220 --out "$OUT" --name gpu-bench-profile17${PROFILE_TAG:-} ${PROFILE_ARGS:-} \
    2>&1 | grep -v Warn | tail -8
}

stage_final17() {  # the seventeenth session's figures at main's CUDA defaults (chained verify passes whose windows may
  # end at in-flight tokens, early verify passes, prefill passes launched before the first tokens before them are
  # read; on top of the sixteenth's): the mixes and the 1k set in every mode (at most 290 s)
  timeout 290 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --deadline-s 280 --out "$OUT" \
    --name gpu-bench-modes-mixes 2>&1 | grep -v Warn | tail -20
}

stage_final17long() {  # the 4k set at the same defaults (at most 170 s)
  timeout 170 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
    --synthetic-sets 16x4096x1024 --modes nondeterministic,dvr_10pct,dvr_100pct,batch_invariant --deadline-s 160 \
    --out "$OUT" --name gpu-bench-modes-4k 2>&1 | grep -v Warn | tail -8
}

stage_levers19() {  # chained verify passes (windows may end at the in-flight tokens) off / on at the CUDA defaults,
  # one machine; dvr 100 % profiled in both
  for cv in off on; do
    timeout 200 python3 -m engine bench --device cuda --sections compare_modes_synthetic \
      --synthetic-sets sharegpt,sharegpt-896x640 --modes nondeterministic,dvr_50pct,dvr_100pct \
      --chained-verify $cv --profile-modes dvr_100pct --deadline-s 190 --out "$OUT" \
      --name gpu-bench-chained-$cv 2>&1 | grep -v Warn | tail -8
  done
}

stage_chaintests() {  # gpu tests of chained verify passes (SmolLM2)
  timeout "${CHAINTESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -s \
    tests/engine/test_gpu_overlap.py 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-chained.txt" | tail -12
}

stage_packtests() {  # the packed verify pass's gpu tests, and the dvr / carry / graphs tests it touches
  timeout "${PACKTESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -s \
    tests/engine/test_gpu_verify_packing.py tests/engine/test_gpu_verify_carry.py \
    tests/engine/test_gpu_engine_graphs.py 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-packing.txt" | tail -30
}

stage_canonical() {
  timeout "${CANONICAL_TIMEOUT:-150}" python3 bench/canonical_step_probe.py --out "$OUT" 2>&1 | tail -14
}

for s in "$@"; do
  log "stage $s"
  "stage_$s"
  log "stage $s done"
done
