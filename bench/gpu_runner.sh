#!/usr/bin/env bash
# Run SpecPilot's engine host and benchmarks on an offline GPU host from the payload built by
# `python -m bench.gpu_payload build` (see docs/gpu.md).
#
#   bash bench/gpu_runner.sh [--part DIR]... [-- COMMAND ARGS...]
#
# Run from the project's root (the project's sources are used from there when present,
# else from the payload). Each --part DIR (a folder .payload/pN holding one part and
# parts.json) is copied to the scratch folder $SPECPILOT_SCRATCH (default /tmp/specpilot-gpu).
# Once every part is there and intact, the runner joins them, unpacks the archive, installs
# the wheels with pip --target, installs the project's vLLM plugin entry points, checks that
# vLLM and the plugins import, and converts the default model (once; later calls reuse all of
# it while the scratch folder lasts). Then it runs COMMAND in that environment with output in
# $OUT (default $SPECPILOT_SCRATCH/out): its console in $OUT/run.log, logs and harness folders
# packed into $OUT/extra.tar.gz.
set -uo pipefail

SCRATCH=${SPECPILOT_SCRATCH:-/tmp/specpilot-gpu}
OUTDIR=${OUT:-$SCRATCH/out}
PY=${PYTHON:-python3}
mkdir -p "$SCRATCH/parts" "$OUTDIR"

parts=()
cmd=()
while [ $# -gt 0 ]; do
  case "$1" in
    --part) parts+=("$2"); shift 2 ;;
    --) shift; cmd=("$@"); break ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) echo "usage: bash bench/gpu_runner.sh [--part DIR]... [-- COMMAND ...]" >&2; exit 2 ;;
  esac
done

t_start=$(date +%s)
for d in "${parts[@]+"${parts[@]}"}"; do
  cp "$d"/payload.tar.xz.part-* "$d"/parts.json "$SCRATCH/parts/" || { echo "cannot copy part $d" >&2; exit 3; }
  echo "[runner] part $(ls "$d"/payload.tar.xz.part-* | xargs -n1 basename) copied to $SCRATCH/parts"
done

ROOT=$SCRATCH/root
SITE=$SCRATCH/site
if [ -d engine_host ] && [ -d bench ]; then PROJ=$PWD; else PROJ=$ROOT/project; fi
export PYTHONPATH="$PROJ:$ROOT/vllm_tree:$SITE:$ROOT/model_pkg${PYTHONPATH:+:$PYTHONPATH}"
export SPECPILOT_HOME=${SPECPILOT_HOME:-$SCRATCH/home}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ ! -f "$SCRATCH/installed" ]; then
  if ! (cd "$PROJ" && "$PY" -m bench.gpu_payload check "$SCRATCH/parts"); then
    if [ ${#cmd[@]} -eq 0 ]; then echo "[runner] parts so far kept in $SCRATCH/parts"; exit 0; fi
    echo "[runner] cannot run the command: parts are missing or corrupt" >&2; exit 3
  fi
  t0=$(date +%s)
  rm -rf "$ROOT" "$SITE"; mkdir -p "$ROOT"
  cat $(ls "$SCRATCH"/parts/payload.tar.xz.part-* | sort -V) | xz -d -T0 | tar -x -C "$ROOT" || { echo "unpack failed" >&2; exit 4; }
  rm -f "$SCRATCH"/parts/payload.tar.xz.part-*
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$ROOT"/wheels/*.whl \
    || { echo "pip install failed" >&2; exit 4; }
  cp -r "$ROOT/specpilot-0.1.0.dist-info" "$SITE/"
  echo "[runner] unpacked and installed in $(( $(date +%s) - t0 )) s"
  "$PY" - <<'EOF'
import importlib.metadata as md, time
t = time.monotonic()
import torch, vllm
from vllm.entrypoints.openai import api_server  # noqa: F401  the `vllm serve` path
print(f"[runner] torch {torch.__version__} cuda {torch.cuda.is_available()}, vllm {vllm.__version__} "
      f"({md.version('vllm')}), API server imports in {time.monotonic() - t:.1f} s")
for g in ("vllm.endpoint_plugins", "vllm.stat_logger_plugins"):
    print(f"[runner] entry points {g}: {[e.value for e in md.entry_points(group=g)]}")
EOF
  t0=$(date +%s)
  "$PY" -m engine_host.model --quiet || { echo "model conversion failed" >&2; exit 5; }
  echo "[runner] model converted in $(( $(date +%s) - t0 )) s"
  touch "$SCRATCH/installed"
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
