#!/usr/bin/env bash
# Run SpecPilot's engine host and benchmarks on an offline GPU host from the payload built by
# `.venv/bin/python scripts/gpu/payload.py build` (see docs/gpu.md).
#
#   bash scripts/gpu/runner.sh [--part DIR]... [-- COMMAND ARGS...]
#
# Run from the project's root (its sources are used from there when present, else from the
# payload). Each --part DIR (a folder .payload/BUNDLE-i holding one part and the bundle's
# parts.json) is copied to the scratch folder $SPECPILOT_SCRATCH (default /tmp/specpilot-gpu).
# Every bundle whose parts are all there and intact is then installed once (payload.py install:
# core = vLLM, the wheels with pip --target and the plugin entry points; qwen15/qwen05 = the
# Qwen GGUFs converted to safetensors), and later calls reuse it while the scratch folder
# lasts. Then COMMAND runs in that environment with output in $OUT (default
# $SPECPILOT_SCRATCH/out): its console in $OUT/run.log, logs and harness folders packed into
# $OUT/extra.tar.gz.
set -uo pipefail

SCRATCH=${SPECPILOT_SCRATCH:-/tmp/specpilot-gpu}
OUTDIR=${OUT:-$SCRATCH/out}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$SCRATCH/parts" "$OUTDIR"

parts=()
cmd=()
while [ $# -gt 0 ]; do
  case "$1" in
    --part) parts+=("$2"); shift 2 ;;
    --) shift; cmd=("$@"); break ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "usage: bash scripts/gpu/runner.sh [--part DIR]... [-- COMMAND ...]" >&2; exit 2 ;;
  esac
done

t_start=$(date +%s)
for d in "${parts[@]+"${parts[@]}"}"; do
  cp "$d"/*.tar.part-* "$d"/*.parts.json "$SCRATCH/parts/" || { echo "cannot copy part $d" >&2; exit 3; }
  echo "[runner] $(ls "$d" | grep tar.part | xargs) copied to $SCRATCH/parts"
done

ROOT=$SCRATCH/root
SITE=$SCRATCH/site
if [ -d engine_host ] && [ -d bench ]; then PROJ=$PWD; else PROJ=$ROOT/project; fi
export PYTHONPATH="$PROJ:$SITE:$ROOT/vllm_tree:$ROOT/model_pkg${PYTHONPATH:+:$PYTHONPATH}"
export SPECPILOT_HOME=${SPECPILOT_HOME:-$SCRATCH/home}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

fresh_core=0
[ -f "$SCRATCH/installed-core" ] || fresh_core=1
"$PY" "$HERE/payload.py" install "$SCRATCH" || { echo "[runner] install failed" >&2; exit 4; }
if [ ! -f "$SCRATCH/installed-core" ]; then
  if [ ${#cmd[@]} -eq 0 ]; then echo "[runner] parts so far kept in $SCRATCH/parts"; exit 0; fi
  echo "[runner] cannot run the command: the core bundle is not complete" >&2; exit 3
fi
if [ $fresh_core -eq 1 ]; then
  "$PY" - <<'EOF'
import importlib.metadata as md, time
t = time.monotonic()
import torch, vllm
from vllm.entrypoints.openai import api_server  # noqa: F401  the `vllm serve` path
print(f"[runner] torch {torch.__version__} cuda {torch.cuda.is_available()}, vllm {vllm.__version__} "
      f"({md.version('vllm')}), API server imports in {time.monotonic() - t:.1f} s")
for g in ("vllm.endpoint_plugins", "vllm.stat_logger_plugins", "vllm.general_plugins"):
    print(f"[runner] entry points {g}: {[e.value for e in md.entry_points(group=g)]}")
EOF
  if [ -z "${SPECPILOT_NO_DEFAULT_MODEL:-}" ]; then  # set it when every command names --model
    t0=$(date +%s)
    "$PY" -m engine_host.model --quiet || { echo "model conversion failed" >&2; exit 5; }
    echo "[runner] default model converted in $(( $(date +%s) - t0 )) s"
  fi
fi
echo "[runner] ready after $(( $(date +%s) - t_start )) s in this call"

rc=0
if [ ${#cmd[@]} -gt 0 ]; then
  echo "[runner] running: ${cmd[*]}"
  OUT=$OUTDIR "${cmd[@]}" 2>&1 | tee -a "$OUTDIR/run.log"
  rc=${PIPESTATUS[0]}
  (cd "$OUTDIR" && ls -d logs harness 2>/dev/null | xargs -r tar -czf extra.tar.gz && rm -rf logs harness)
fi
exit "$rc"
