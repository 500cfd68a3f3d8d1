#!/usr/bin/env bash
# K = 0 in the n-gram engine at 64 clients, before and after speculative steps, against plain
# vLLM and plain vLLM with SpecPilot's stat logger (docs/gpu.md).
#
#   bash scripts/gpu/k0_history.sh MODEL RESULTS
#
# Run inside the offline environment (`bash scripts/gpu/runner.sh -- bash scripts/gpu/k0_history.sh ...`).
# Three engines start together and stay up together on the one GPU (16 GiB of KV cache each):
# plain `vllm serve`, plain `vllm serve` with only the specpilot_stats logger plugin, and the
# engine host (ngram_gpu, K_max 4) at fixed K = 0. Then, in this order:
#   1. `bench host-overhead`: vLLM's generation counter over 6 s windows of chat at 64 clients,
#      one round over the three engines (engine-side throughput, the engine host never drafted);
#   2. `bench matrix` code and chat at 64 clients (client-side throughput, fixed work):
#      cold    fixed:0 with plain vLLM's column, before any speculative step;
#      stats   fixed:0 with the stats engine as the plain column;
#      after4  fixed:4 then fixed:0;
#      afterA  adaptive then fixed:0;
#   3. with PY_SPY=<py-spy executable>: `bench profile-step --attach` at 64 clients on plain vLLM
#      and the engine host at K = 0, after the cold cells and again after adaptive (CPU ms per step
#      by component in the engine-core process);
#   4. `bench matrix` code, docs, chat and mixed at 1 client (adaptive, K = 0, K = 4, plain): the
#      per-request gate under async scheduling (LOW=0 skips it);
#   5. `bench host-overhead` once more (engine-side, now after speculative steps); every engine is
#      stopped when the script ends, however it ends.
# Around each matrix call it prints the CPU seconds each engine's API-server process spent (ps
# cputimes): with the cells' output tokens, the frontend's CPU per streamed token, which the
# engine-side windows of step 1 do not see (their requests are not streamed).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
M=${1:?usage: k0_history.sh MODEL RESULTS}
R=${2:?usage: k0_history.sh MODEL RESULTS}
S=$R/state.json
KV=${KV_BYTES:-17179869184}
PLAIN="--gpu-memory-utilization 0.3 --kv-cache-memory-bytes $KV --no-enable-prefix-caching --max-num-seqs 64"
engines=(
  --engine "serve:plain:$PLAIN"
  --engine "serve:stats:VLLM_PLUGINS=specpilot_stats $PLAIN"
  --engine "host:ngram:--speculative-method ngram_gpu --k-max 4 --speculation-mode fixed --k 0 --no-prefix-caching --max-num-seqs 64 --max-model-len 2048 --gpu-memory-utilization 0.3 --warmup quick -- --kv-cache-memory-bytes $KV"
)
mkdir -p "$R"
# the engines are kept up between the steps (--keep); stop them however the script ends
trap 'stop_engines "$M" "$S" "$R/overhead-after"' EXIT
overhead() {  # OUT
  python3 -m bench host-overhead --model "$M" --parallel-start --keep --state "$S" --out "$1" \
    --workloads chat,code --loads 64 --rounds 1 --duration 6 --warm 3 --only plain,stats,ngram "${engines[@]}"
}
overhead "$R/overhead-before" || exit $?
eval "$(engine_vars "$S")"
[ -n "${NGRAM_URL:-}" ] && [ -n "${PLAIN_URL:-}" ] && [ -n "${STATS_URL:-}" ] || { echo "the engines are not up (see $S)" >&2; exit 3; }
api_cpu() { ps -o pid=,cputimes= -p "$PLAIN_PID" -p "$STATS_PID" -p "$NGRAM_PID" | xargs; }
m() {  # PLAIN_URL MODES OUT
  local c0 c1
  c0=$(api_cpu)
  SPECPILOT_CONTROL_TOKEN=$NGRAM_TOKEN python3 -m bench matrix --url "$NGRAM_URL" --plain-baseline --plain-url "$1" \
    --workloads code,chat --loads high --load-def high=c64 --modes "$2" --requests-per-client high=2 \
    --out "$3" --no-png --quiet
  c1=$(api_cpu)
  echo "$3: API-server pid and CPU s (plain $PLAIN_PID, stats $STATS_PID, ngram $NGRAM_PID) before: $c0  after: $c1" | tee -a "$R/api-cpu.txt"
}
profile() {  # OUT [profile-step args]
  [ -n "${PY_SPY:-}" ] || return 0
  python3 -m bench profile-step --attach "$S" --clients 64 --seconds 10 --py-spy "$PY_SPY" --out "$1" "${@:2}" | tee "$1.md"
}
m "$PLAIN_URL" fixed:0 "$R/cold"
m "$STATS_URL" fixed:0 "$R/stats"
profile "$R/profile-cold" --engines plain,ngram
m "$PLAIN_URL" fixed:4,fixed:0 "$R/after4"
m "$PLAIN_URL" adaptive,fixed:0 "$R/afterA"
profile "$R/profile-afterA" --engines ngram --mode fixed:0
if [ "${LOW:-1}" != 0 ]; then
  SPECPILOT_CONTROL_TOKEN=$NGRAM_TOKEN python3 -m bench matrix --url "$NGRAM_URL" --plain-baseline --plain-url "$PLAIN_URL" \
    --workloads code,docs,chat,mixed --loads low --load-def low=c1 --modes adaptive,fixed:0,fixed:4 \
    --requests-per-client low=8 --out "$R/low" --no-png --quiet
fi
overhead "$R/overhead-after"
