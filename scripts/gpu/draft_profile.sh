#!/usr/bin/env bash
# The draft-model engine against plain vLLM, step by step (docs/gpu.md): `bench torch-profile`
# for the 1.5B target with the 0.5B draft at K = 4 (the draft's decode passes in FULL CUDA
# graphs, then with SPECPILOT_DRAFT_DECODE_GRAPHS=0: piecewise graphs only), plain vLLM on the
# 1.5B and on the 0.5B alone (what one draft pass costs against one target step).
#
#   bash scripts/gpu/draft_profile.sh MODELS RESULTS [PART...]
#
# MODELS holds Qwen2.5-Coder-1.5B-Instruct and Qwen2.5-Coder-0.5B-Instruct (the payload's
# qwen15 and qwen05 bundles). PART picks runs (default all): draft4 draft4-piecewise plain
# plain-draft draft2 draft1. Environment: BATCHES (default 1,8,64), TOKENS (default 128).
# Run inside the offline environment (`bash scripts/gpu/runner.sh -- bash scripts/gpu/draft_profile.sh ...`).
set -uo pipefail
H=${1:?usage: draft_profile.sh MODELS RESULTS [PART...]}
R=${2:?usage: draft_profile.sh MODELS RESULTS [PART...]}
shift 2
T=$H/Qwen2.5-Coder-1.5B-Instruct
D=$H/Qwen2.5-Coder-0.5B-Instruct
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(draft4 draft4-piecewise plain plain-draft draft2 draft1)
mkdir -p "$R"
tp() {  # NAME ARGS...
  local name=$1
  shift
  echo "== $name $(date +%T)"
  python3 -m bench torch-profile --batches "${BATCHES:-1,8,64}" --max-tokens "${TOKENS:-128}" --out "$R/$name" "$@" \
    > "$R/$name.log" 2>&1
  echo "== $name rc=$? $(date +%T)"
  grep -h "ms/step" "$R/$name/torch-profile.md" 2>/dev/null | grep "^###"
  grep -h "SpecPilot:" "$R/$name.log" | sort | uniq -c | head -20
}
draft=(--model "$T" --speculative-method draft_model --draft-model "$D")
for p in "${parts[@]}"; do
  case "$p" in
    draft4) tp draft4 "${draft[@]}" --k 4 ;;
    draft4-piecewise) SPECPILOT_DRAFT_DECODE_GRAPHS=0 tp draft4-piecewise "${draft[@]}" --k 4 ;;
    draft2) tp draft2 "${draft[@]}" --k 2 ;;
    draft1) tp draft1 "${draft[@]}" --k 1 ;;
    plain) tp plain --model "$T" ;;
    plain-draft) tp plain-draft --model "$D" ;;
    *) echo "unknown part $p" >&2 ;;
  esac
done
