#!/usr/bin/env bash
# The real-width rehearsal (scripts/rehearse_real.py): DeepSeek-V2-Lite, Qwen1.5-MoE and Phi-3.5-MoE
# at their real widths and vocabularies, 2 layers, random weights, through every method at both tiers'
# slot counts; greedy tokens equal, budgets enforced at real byte counts, footprints equal the plan's.
# Usage: bash scripts/rehearse_real.sh [--models dsv2 ...] [--layers 2] [--keep]
#   DEVICE=cpu|cuda (default cpu)  QUANT=gptq|rtn (default gptq; rtn where gptqmodel is absent)
#   OUT_CSV=path (default <workdir>/rehearsal.csv)
# Needs ~12 GB of free memory on the CPU (Phi-3.5-MoE's two layers in bfloat16) and a few GB of temp space.
set -euo pipefail
cd "$(dirname "$0")/.."
export GPTQMODEL_CPU_WORKERS="${GPTQMODEL_CPU_WORKERS:-2}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec "${PYTHON:-python}" -m scripts.rehearse_real "$@"
