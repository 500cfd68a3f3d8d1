#!/usr/bin/env bash
# K = 0 at 64 clients: which CUDA graphs each engine's steps ran, and where the engine core's CPU
# time goes, for plain vLLM, vLLM's own ngram_gpu engine whose batch-size table gives K = 0
# everywhere (no SpecPilot part) and the engine host at fixed K = 0 (docs/gpu.md).
#
#   PY_SPY=<py-spy> bash scripts/gpu/k0_cudagraphs.sh MODEL RESULTS
#
# Run inside the offline environment (`bash scripts/gpu/runner.sh -- bash scripts/gpu/k0_cudagraphs.sh ...`).
# Every engine runs with vLLM's `--cudagraph-metrics`, so its log holds, every log interval, the
# steps per CUDA-graph mode and padded size. Steps: one engine-side round of chat and code at 64
# clients; `bench matrix` chat and code at 64 clients (streamed, fixed work) against each of the
# two other engines; with TABLE=1, the n-gram table (code, docs, chat, mixed and shift at 1, 8 and
# 64 clients; adaptive, K = 0, 2, 4 and plain vLLM; REQS requests per client, default
# low=8,medium=4,high=2); with PY_SPY, `bench profile-step --attach` at 64 clients on all three.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
M=${1:?usage: k0_cudagraphs.sh MODEL RESULTS}
R=${2:?usage: k0_cudagraphs.sh MODEL RESULTS}
S=$R/state.json
KV=${KV_BYTES:-17179869184}
PLAIN="--gpu-memory-utilization 0.3 --kv-cache-memory-bytes $KV --no-enable-prefix-caching --max-num-seqs 64 --cudagraph-metrics"
VK0='{"method":"ngram_gpu","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":4,"num_speculative_tokens_per_batch_size":[[1,1048576,0]]}'
engines=(
  --engine "serve:plain:$PLAIN"
  --engine "serve:vk0:$PLAIN --speculative-config '$VK0'"
  --engine "host:ngram:--speculative-method ngram_gpu --k-max 4 --speculation-mode fixed --k 0 --no-prefix-caching --max-num-seqs 64 --max-model-len 2048 --gpu-memory-utilization 0.3 --warmup quick -- --kv-cache-memory-bytes $KV --cudagraph-metrics"
)
mkdir -p "$R"
trap 'stop_engines "$M" "$S" "$R/overhead"' EXIT
python3 -m bench host-overhead --model "$M" --parallel-start --keep --state "$S" --out "$R/overhead" \
  --workloads chat,code --loads 64 --rounds 1 --duration 6 --warm 3 "${engines[@]}" || exit $?
eval "$(engine_vars "$S")"
[ -n "${NGRAM_URL:-}" ] && [ -n "${PLAIN_URL:-}" ] && [ -n "${VK0_URL:-}" ] || { echo "the engines are not up (see $S)" >&2; exit 3; }
for other in PLAIN VK0; do
  url=${other}_URL
  SPECPILOT_CONTROL_TOKEN=$NGRAM_TOKEN python3 -m bench matrix --url "$NGRAM_URL" --plain-baseline --plain-url "${!url}" \
    --workloads code,chat --loads high --load-def high=c64 --modes fixed:0 --requests-per-client high=2 \
    --out "$R/matrix-vs-${other,,}" --no-png --quiet
done
if [ "${TABLE:-0}" = 1 ]; then
  SPECPILOT_CONTROL_TOKEN=$NGRAM_TOKEN python3 -m bench matrix --url "$NGRAM_URL" --plain-baseline --plain-url "$PLAIN_URL" \
    --workloads code,docs,chat,mixed,shift --loads low,medium,high --load-def low=c1 --load-def medium=c8 --load-def high=c64 \
    --modes adaptive,fixed:0,fixed:2,fixed:4 --requests-per-client "${REQS:-low=8,medium=4,high=2}" \
    --out "$R/table" --no-png --quiet
fi
if [ -n "${PY_SPY:-}" ]; then
  python3 -m bench profile-step --attach "$S" --clients 64 --seconds 10 --py-spy "$PY_SPY" --out "$R/profile" \
    --engines plain,vk0,ngram --mode fixed:0 | tee "$R/profile.md"  # the engine host back at K = 0 after the table
fi
