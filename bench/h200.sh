#!/usr/bin/env bash
# The H200 runs behind docs/performance.md, and the GPU tests; one stage per device call (each <= 10 min).
#
#   bash bench/h200.sh STAGE [STAGE ...]      from the source root on the GPU machine; results go to $OUT
#
# Stages:
#   setup       gather the carried wheels (.gpu/whl-a, -b, -c made by bench/gpu-wheels.sh, which lists the three
#               calls; .whl) in ~/gmw and install them into /tmp/site
#               with the last part (the machine has torch, triton and transformers, not the service's
#               dependencies), and put the SmolLM2 GGUF at $VERBATIM_GPU_GGUF (joined in ~/gm from the parts in
#               .gpu/model-a, -b and -c, once model-c has come); run once per call that carries a part
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
#   tests1 .. tests4   every `gpu`-marked test of tests/engine in up to four device calls (GPU_TESTS_1, _3 and _4
#               list the first, third and fourth stages' files, the second takes the rest; tests1 and tests3
#               fit one call)        -> gpu-pytest-1.txt, gpu-pytest-2.txt, gpu-pytest-3.txt, gpu-pytest-4.txt
#   sampler     the sampler alone and the SmolLM2 engine per sampling preset: bench/sampler_bench.py
#                                                                   -> sampler-bench.json
#   serve       the service through the API beside the engine alone, the synthetic 8B and SmolLM2 (SERVE_MODELS
#               picks some of "8b smollm2"): bench/serve_bench.py
#                                                    -> serve-bench-8b.json / .png, serve-bench-smollm2.json / .png
#   tp          nvidia-h200-x2: tensor parallelism against one GPU on the synthetic 8B (bench/tp_bench.py; one
#               engine per process: TP_SIZES x nondeterministic / dvr / batch_invariant, all-reduce
#               TP_REDUCTION, default gather_sum)     -> tp-bench-<reduction>.json / .png (+ the runs' JSON)
#   tptests     nvidia-h200-x2: the gpu tests of tensor parallelism, one pytest process per (model, reduction)
#               and one for the one-rank group (TPTESTS_KEYS picks some, e.g. "one_rank" on one H200; the five
#               may take more than one device call)                  -> gpu-pytest-tp.txt
#   stream      the verify cadence (issue 26): one stream alone and 8 at once, 256 tokens, deterministic at
#               STREAM_CADENCES (default 0,8,12,16) against non-deterministic, the synthetic 8B and SmolLM2:
#               bench/stream_bench.py             -> stream-bench-8b.json / .png, stream-bench-smollm2.json / .png
#   chunks      chunked canonical prefill GEMMs at CHUNK (256) rows on the synthetic 8B: its gpu test, one stream
#               and 8 through the engine, the mode comparison on the ShareGPT-like mixes
#                      -> gpu-pytest-chunks.txt, stream-bench-8b-chunk256.json, gpu-bench-modes-mixes-chunk256.json
#   schema      25 % of the requests under a JSON schema against the same mix without: SmolLM2, then the
#               synthetic 8B (bench/schema_mix_bench.py; SCHEMA_MODELS picks some of "smollm2 8b")
#                                                           -> schema-mix-smollm2.json, schema-mix-8b.json
#   proctests   the gpu tests of the logits processors and grammars -> gpu-pytest-processors.txt
#   contention  SmolLM2's engine core under CPU load from other processes, with and without a core of its own:
#               bench/contention_probe.py                 -> contention-probe.json
#   serveprof   SmolLM2 through the API with py-spy on the service's processes during the saturation runs, and
#               every Python process of the run sampled by bench/profiling/sitecustomize.py
#               -> serve-profile.txt, serve-profiles.tgz (serve-top.txt, serve-threads.txt, prof/<pid>.txt), the JSON
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
GGUF=${VERBATIM_GPU_GGUF:-$HOME/gm/SmolLM2-135M-Instruct.Q4_1.gguf}
export VERBATIM_GPU_GGUF=$GGUF VERBATIM_GGUF=$GGUF
log() { echo "[$(date -u +%H:%M:%S)] $*"; }

stage_setup() {  # one call per carried part: the wheels and the model arrive in parts (64 MiB a call)
  mkdir -p ~/gm ~/gmw
  for d in .gpu/whl-a .gpu/whl-b .gpu/whl-c .whl; do [ -d "$d" ] && cp "$d"/*.whl ~/gmw/ 2>/dev/null; done
  for d in .gpu/model-a .gpu/model-b .gpu/model-c; do [ -d "$d" ] && cp "$d"/part-* ~/gm/; done
  if [ -d .gpu/whl-c ] && [ ! -d /tmp/site ]; then  # the last part is here: install everything
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ~/gmw/*.whl 2>&1 | grep -v WARNING
  fi
  if [ ! -s "$GGUF" ] && [ -d .gpu/model-c ]; then  # the last part is here: join them
    cat ~/gm/part-a? > "$GGUF"
  fi
  ls -la "$GGUF" ~/gmw | tail -3 || true
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
}

stage_mixes() {  # at most 290 s
  timeout "${MIXES_TIMEOUT:-290}" python3 -m bench engine --sections compare_modes_synthetic \
    --synthetic-sets sharegpt,sharegpt-896x640,16x1024x256 --deadline-s 280 --out "$OUT" \
    --name gpu-bench-modes-mixes ${MIXES_ARGS:-} 2>&1 | grep -v Warn | tail -20
}

stage_long4k() {  # at most 170 s
  timeout "${LONG4K_TIMEOUT:-170}" python3 -m bench engine --sections compare_modes_synthetic \
    --synthetic-sets 16x4096x1024 --modes nondeterministic,dvr_10pct,dvr_100pct,batch_invariant --deadline-s 160 \
    --out "$OUT" --name gpu-bench-modes-4k ${LONG4K_ARGS:-} 2>&1 | grep -v Warn | tail -8
}

stage_core() {
  timeout "${CORE_TIMEOUT:-540}" python3 -m bench engine --sections core --out "$OUT" \
    --name gpu-bench-8b ${CORE_ARGS:-} 2>&1 | tail -60
}

stage_replay() {
  timeout "${REPLAY_TIMEOUT:-300}" python3 -m bench replay --out "$OUT" 2>&1 | tail -30
}

stage_rollback() {
  timeout "${ROLLBACK_TIMEOUT:-300}" python3 -m bench engine --sections smollm2_rollback --gguf "$GGUF" \
    --out "$OUT" --name gpu-bench-rollback 2>&1 | tail -20
}

stage_probe() {
  timeout "${PROBE_TIMEOUT:-240}" python3 -m bench bi-matmul --out "$OUT" 2>&1 | tail -70
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
GPU_TESTS_3="tests/engine/test_gpu_processors.py tests/engine/test_gpu_query_tile.py
  tests/engine/test_gpu_tensor_parallel.py"
GPU_TESTS_4="tests/engine/test_fused_gpu.py"

stage_tests1() {
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=15 \
    $GPU_TESTS_1 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-1.txt" | tail -40
}

stage_tests2() {
  local skip=()
  for f in $GPU_TESTS_1 $GPU_TESTS_3 $GPU_TESTS_4; do skip+=(--ignore="$f"); done
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=15 \
    "${skip[@]}" tests/engine 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-2.txt" | tail -40
}

stage_tests3() {
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=15 \
    $GPU_TESTS_3 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-3.txt" | tail -40
}

stage_tests4() {
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=15 \
    $GPU_TESTS_4 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-4.txt" | tail -40
}

stage_sampler() {  # the copy on the machine may carry no .git, or an older one: GIT_COMMIT names the tree
  timeout "${SAMPLER_TIMEOUT:-240}" python3 bench/sampler_bench.py --out "$OUT" --gguf "$GGUF" \
    ${GIT_COMMIT:+--git-commit $GIT_COMMIT} 2>&1 \
    | grep -v Warn | tail -12
}

stage_serve() {  # issues 25 (item 3) and 26: the service through the API beside the engine alone, the synthetic 8B
  # and SmolLM2 (bench/serve_bench.py; at most 420 + 550 s, so one model a call; each run bounded by its
  # --deadline-s). The copy on the machine has no .git: GIT_COMMIT=$(git rev-parse HEAD) names the tree in the JSON.
  # SERVE_MODELS picks some of "8b smollm2"
  local commit=${GIT_COMMIT:+--git-commit $GIT_COMMIT} models=" ${SERVE_MODELS:-8b smollm2} "
  # (on a machine that has not loaded the GGUF before, SmolLM2's engine takes about a minute to load)
  [[ $models == *" 8b "* ]] && timeout "${SERVE_8B_TIMEOUT:-420}" python3 bench/serve_bench.py --model synthetic-8b \
    --deadline-s 400 $commit --out "$OUT" --name serve-bench-8b ${SERVE_ARGS:-} 2>&1 | grep -v Warn | tail -30
  [[ $models == *" smollm2 "* ]] && timeout "${SERVE_SMOL_TIMEOUT:-550}" python3 bench/serve_bench.py --model "$GGUF" \
    --quick --deadline-s 520 $commit --out "$OUT" --name serve-bench-smollm2 ${SERVE_ARGS:-} 2>&1 \
    | grep -v Warn | tail -30
  return 0
}

stage_tp() {  # 6 engines, each bounded by TP_RUN_TIMEOUT (about 1 min each on the H200 pair, untimed start-up included)
  local reduction=${TP_REDUCTION:-gather_sum} tp mode
  for tp in ${TP_SIZES:-1 2}; do
    for mode in nondeterministic dvr batch_invariant; do
      timeout "${TP_RUN_TIMEOUT:-150}" python3 bench/tp_bench.py run --tp "$tp" --engine-mode "$mode" \
        --reduction "$reduction" --out "$OUT/tp-$reduction" ${TP_ARGS:-} 2>&1 | grep -v Warn | tail -5
    done
  done
  python3 bench/tp_bench.py report "$OUT/tp-$reduction" --out "$OUT" --name "tp-bench-$reduction" 2>&1 | tail -30
}

stage_tptests() {
  local k
  : > "$OUT/gpu-pytest-tp.txt"
  for k in ${TPTESTS_KEYS:-one_rank smollm2-gather_sum smollm2-nccl synthetic-8b-gather_sum synthetic-8b-nccl}; do
    timeout "${TPTESTS_TIMEOUT:-280}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -k "$k" \
      tests/engine/test_gpu_tensor_parallel.py 2>&1 | grep -v Warn | tee -a "$OUT/gpu-pytest-tp.txt" | tail -8
  done
}

stage_stream() {  # issue 26: per-token commit times through the engine alone (at most 300 + 200 s)
  local cadences=${STREAM_CADENCES:-0,8,12,16}
  timeout "${STREAM_8B_TIMEOUT:-300}" python3 bench/stream_bench.py --device cuda --model synthetic:llama-3.1-8b \
    --max-tokens 256 --cadences "$cadences" --concurrency 1,8 --repeats 3 --out "$OUT" --name stream-bench-8b \
    ${STREAM_ARGS:-} 2>&1 | grep -v Warn | tail -14
  timeout "${STREAM_SMOL_TIMEOUT:-200}" python3 bench/stream_bench.py --device cuda --model "$GGUF" \
    --max-tokens 256 --cadences "$cadences" --concurrency 1,8 --repeats 3 --out "$OUT" --name stream-bench-smollm2 \
    ${STREAM_ARGS:-} 2>&1 | grep -v Warn | tail -14
}

stage_serveprof() {  # SmolLM2 through the API with py-spy sampling the service's processes at saturation (260 s;
  # the fixed 1024-request set sent once per mode: every process sampled, a set sized to 5 s of the engine core
  # does not fit)
  # (py-spy comes with bench/gpu-wheels.sh); the stacks: $OUT/serve-profile.txt (py-spy's raw format, one line
  # per stack and thread with its sample count, idle threads included, so that where a process waits shows;
  # bench/profiling/report.py reads it); in $OUT/serve-profiles.tgz
  # the sampler's prof/<pid>.txt, the processes' CPU (serve-top.txt) and their busy threads (serve-threads.txt)
  ( PYTHONPATH=$PWD/bench/profiling:$PYTHONPATH VERBATIM_PROFILE_DIR=$OUT/prof timeout "${SERVEPROF_TIMEOUT:-260}" \
      python3 bench/serve_bench.py --model "$GGUF" --quick --saturation-s 0 --service-repeats 1 --deadline-s 240 \
      ${GIT_COMMIT:+--git-commit $GIT_COMMIT} --out "$OUT" --name serve-bench-smollm2-profiled \
      > "$OUT/serve-bench-profiled.log" 2>&1 ) &
  local bench=$! i pid
  for i in $(seq 1600); do grep -q "streams through the API" "$OUT/serve-bench-profiled.log" 2>/dev/null && break; sleep 0.1; done
  pid=$(pgrep -f "auditor serve --data-dir" | head -1)
  if [ -n "$pid" ]; then
    /tmp/site/bin/py-spy record --subprocesses --nonblocking --idle --format raw -r 100 -d 12 --pid "$pid" \
      -o "$OUT/serve-profile.txt" > "$OUT/py-spy.log" 2>&1 &
    top -H -b -d 2 -n 5 -w 200 | grep -v " 0.0 " | head -500 > "$OUT/serve-threads.txt" &
    top -b -d 2 -n 5 | grep -E "python|PID" > "$OUT/serve-top.txt"
  fi
  wait
  # one archive: a call brings back only so many files
  tar czf "$OUT/serve-profiles.tgz" -C "$OUT" prof serve-top.txt serve-threads.txt py-spy.log 2>/dev/null \
    && rm -rf "$OUT/prof" "$OUT/serve-top.txt" "$OUT/serve-threads.txt"
  grep -v Warn "$OUT/serve-bench-profiled.log" | tail -20
}

stage_contention() {  # the engine core's step under CPU load, placed and not (bench/contention_probe.py; ~150 s)
  timeout "${CONTENTION_TIMEOUT:-240}" python3 bench/contention_probe.py --model "$GGUF" --out "$OUT" \
    2>&1 | grep -v Warn | tail -12
}

stage_chunks() {  # issue 26: chunked canonical prefill GEMMs (canonical_prefill_chunk_tokens = CHUNK, 256) on the
  # synthetic 8B: its gpu test, one stream and 8 through the engine at the default cadence, and the mode comparison
  # on the two ShareGPT-like mixes (at most 90 + 200 + 280 s); CHUNK=0: the same runs unchunked
  local c=${CHUNK:-256}
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/engine/test_gpu_canonical_prefill_chunks.py \
    2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-chunks.txt" | tail -6
  timeout 200 python3 bench/stream_bench.py --device cuda --model synthetic:llama-3.1-8b --max-tokens 256 \
    --cadences 8 --concurrency 1,8 --repeats 3 --engine-option "tuning={\"canonical_prefill_chunk_tokens\": $c}" \
    --out "$OUT" --name "stream-bench-8b-chunk$c" 2>&1 | grep -v Warn | tail -8
  timeout 280 python3 -m bench engine --sections compare_modes_synthetic --synthetic-sets sharegpt,sharegpt-896x640 \
    --modes nondeterministic,dvr_10pct,dvr_100pct --canonical-prefill-chunk-tokens "$c" --deadline-s 270 \
    --out "$OUT" --name "gpu-bench-modes-mixes-chunk$c" 2>&1 | grep -v Warn | tail -12
  return 0
}

stage_schema() {  # at most 200 + 380 s; SCHEMA_MODELS picks some of "smollm2 8b"
  local models=" ${SCHEMA_MODELS:-smollm2 8b} "
  [[ $models == *" smollm2 "* ]] && timeout "${SCHEMA_SMOL_TIMEOUT:-200}" python3 bench/schema_mix_bench.py \
    --models smollm2 --gguf "$GGUF" --schema-share 0.25 --out "$OUT" --name schema-mix-smollm2 ${SCHEMA_ARGS:-} \
    2>&1 | grep -v Warn | tail -6
  [[ $models == *" 8b "* ]] && timeout "${SCHEMA_8B_TIMEOUT:-380}" python3 bench/schema_mix_bench.py \
    --models synthetic --gguf "$GGUF" --schema-share 0.25 --cap-s 30 --out "$OUT" --name schema-mix-8b \
    ${SCHEMA_ARGS:-} 2>&1 | grep -v Warn | tail -6
  return 0
}

stage_proctests() {
  timeout "${PROCTESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=10 \
    tests/engine/test_gpu_processors.py 2>&1 | grep -v Warn | tee "$OUT/gpu-pytest-processors.txt" | tail -25
}

for s in "$@"; do
  log "stage $s"
  "stage_$s"
  log "stage $s done"
done
