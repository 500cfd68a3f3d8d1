#!/usr/bin/env bash
# Speculation off (K = 0) in one engine against plain vLLM at few clients: paired windows, then
# where each engine's step goes (docs/gpu.md).
#
#   PY_SPY=<py-spy> bash scripts/gpu/k0_profile.sh MODEL RESULTS
#
# Run inside the offline environment (`bash scripts/gpu/runner.sh -- bash scripts/gpu/k0_profile.sh ...`).
# Plain `vllm serve` and the engine host with ngram_gpu at fixed K = 0 start together (same KV
# cache size); `bench host-overhead` takes closed-loop chat windows at LOADS clients (default 1,8)
# round-robin, ROUNDS rounds (default 6) of DURATION s (default 6); then, with PY_SPY, `bench
# profile-step --attach` samples both engine cores at each of CLIENTS (default "1 8"), one engine
# loaded at a time. The engines are stopped at the end.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
M=${1:?usage: k0_profile.sh MODEL RESULTS}
R=${2:?usage: k0_profile.sh MODEL RESULTS}
S=$R/state.json
KV=${KV_BYTES:-17179869184}
engines=(
  --engine "serve:plain:--gpu-memory-utilization 0.3 --kv-cache-memory-bytes $KV --no-enable-prefix-caching --max-num-seqs 64"
  --engine "host:ngram:--speculative-method ngram_gpu --k-max 4 --speculation-mode fixed --k 0 --no-prefix-caching --max-num-seqs 64 --max-model-len 2048 --gpu-memory-utilization 0.3 --warmup quick -- --kv-cache-memory-bytes $KV"
)
mkdir -p "$R"
trap 'stop_engines "$M" "$S" "$R/overhead"' EXIT
python3 -m bench host-overhead --model "$M" --parallel-start --keep --state "$S" --out "$R/overhead" \
  --workloads chat --loads "${LOADS:-1,8}" --rounds "${ROUNDS:-6}" --duration "${DURATION:-6}" --warm 2 \
  "${engines[@]}" || exit $?
if [ -n "${PY_SPY:-}" ]; then
  for c in ${CLIENTS:-1 8}; do
    python3 -m bench profile-step --attach "$S" --engines plain,ngram --clients "$c" --seconds 12 \
      --py-spy "$PY_SPY" --out "$R/profile-c$c" | tee "$R/profile-c$c.md"
  done
fi
