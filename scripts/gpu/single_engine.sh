#!/usr/bin/env bash
# One speculative engine against plain vLLM on one GPU, both kept up together (docs/gpu.md).
#
#   bash scripts/gpu/single_engine.sh MODEL RESULTS [MATRIX_ARGS...]
#
# Run inside the offline environment (`bash scripts/gpu/runner.sh -- bash scripts/gpu/single_engine.sh ...`)
# or wherever `python3 -m bench` finds vLLM. Two steps, both on the same two engines:
#   1. `bench host-overhead`: plain `vllm serve` (no speculative config) and the engine host with
#      ngram_gpu at fixed K = 0 start together (same KV cache size, so vLLM's memory profiling is
#      skipped and the engines cannot disturb each other's), then closed-loop chat windows at
#      1, 8 and 64 clients taken round-robin (ROUNDS rounds) with TTFTs; the engines are kept.
#   2. `bench matrix` against the kept engines: code, docs, chat, mixed and shift at 1, 8 and 64
#      clients, modes adaptive and fixed K (MODES), with plain vLLM's column from the plain engine.
#   1b. with PY_SPY=<py-spy executable>: `bench profile-step --attach` samples plain vLLM and the
#      engine host at K = 0 under 1 client (where each one's step time goes, CPU side); engines
#      PROFILE_ENGINES (plain,ngram); PROFILE_MODE (e.g. fixed:4) profiles PROFILE_MODE_ENGINES
#      (ngram) once more at that mode.
# Environment: KV_BYTES (KV cache per engine, default 16 GiB), K_MAX (default 4), ROUNDS (3),
# DURATION (timed window, s, 8), MODES (adaptive,fixed:0,fixed:2,fixed:4), REQS (fixed work per
# client, low=8,medium=4,high=2), RUNS (the whole table this many times, 2: matrix-ngram-1, ...),
# DRAFT (a draft model folder: a third engine, `--speculative-method draft_model`, with its own
# table matrix-draft-N after each of the first DRAFT_RUNS (default RUNS) n-gram tables, modes
# DRAFT_MODES, default adaptive,fixed:2,fixed:4),
# STOP=1 stops the engines at the end.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
M=${1:?usage: single_engine.sh MODEL RESULTS [MATRIX_ARGS...]}
R=${2:?usage: single_engine.sh MODEL RESULTS [MATRIX_ARGS...]}
shift 2
S=$R/state.json
KV=${KV_BYTES:-17179869184}
K_MAX=${K_MAX:-4}
COMMON="--no-prefix-caching --max-num-seqs 64 --max-model-len 2048 --gpu-memory-utilization 0.3 --warmup quick"
engines=(
  --engine "serve:plain:--gpu-memory-utilization 0.3 --kv-cache-memory-bytes $KV --no-enable-prefix-caching --max-num-seqs 64"
  --engine "host:ngram:--speculative-method ngram_gpu --k-max $K_MAX --speculation-mode fixed --k 0 $COMMON -- --kv-cache-memory-bytes $KV"
)
if [ -n "${DRAFT:-}" ]; then
  engines+=(--engine "host:draft:--speculative-method draft_model --draft-model $DRAFT --k-max $K_MAX --speculation-mode fixed --k 0 $COMMON -- --kv-cache-memory-bytes $KV")
fi
mkdir -p "$R"
python3 -m bench host-overhead --model "$M" --parallel-start --keep --state "$S" --out "$R/overhead" \
  --workloads chat --loads 1,8,64 --rounds "${ROUNDS:-3}" --duration "${DURATION:-8}" --warm 3 --only plain,ngram \
  "${engines[@]}" || exit $?
if [ -n "${PY_SPY:-}" ]; then
  python3 -m bench profile-step --attach "$S" --engines "${PROFILE_ENGINES:-plain,ngram}" --clients 1 --seconds 12 --py-spy "$PY_SPY" \
    --out "$R/profile-c1" | tee "$R/profile-c1.md"
  if [ -n "${PROFILE_MODE:-}" ]; then  # the same engines again at a speculative mode (e.g. fixed:4)
    python3 -m bench profile-step --attach "$S" --engines "${PROFILE_MODE_ENGINES:-ngram}" --mode "$PROFILE_MODE" \
      --clients 1 --seconds 12 --py-spy "$PY_SPY" --out "$R/profile-c1-mode" | tee "$R/profile-c1-mode.md"
  fi
fi

# the kept engines' addresses and control tokens, from the state file
eval "$(engine_vars "$S")"
[ -n "${NGRAM_URL:-}" ] && [ -n "${PLAIN_URL:-}" ] || { echo "the engines are not up (see $S)" >&2; exit 3; }
matrix() {  # URL TOKEN OUT PLAIN?
  SPECPILOT_CONTROL_TOKEN=$2 python3 -m bench matrix --url "$1" ${4:+--plain-baseline --plain-url "$PLAIN_URL"} \
    --workloads code,docs,chat,mixed,shift --loads low,medium,high \
    --load-def low=c1 --load-def medium=c8 --load-def high=c64 \
    --modes "${MODES:-adaptive,fixed:0,fixed:2,fixed:4}" --requests-per-client "${REQS:-low=8,medium=4,high=2}" \
    --out "$3" --no-png --quiet "${@:5}"
}
for i in $(seq 1 "${RUNS:-2}"); do
  matrix "$NGRAM_URL" "$NGRAM_TOKEN" "$R/matrix-ngram-$i" plain "$@"
  if [ -n "${DRAFT_URL:-}" ] && [ "$i" -le "${DRAFT_RUNS:-${RUNS:-2}}" ]; then
    MODES=${DRAFT_MODES:-adaptive,fixed:2,fixed:4} matrix "$DRAFT_URL" "$DRAFT_TOKEN" "$R/matrix-draft-$i" "" "$@"
  fi
done
if [ -n "${STOP:-}" ]; then
  stop_engines "$M" "$S" "$R/overhead"
fi
