#!/usr/bin/env bash
# GPU checks in one short call (about 5 minutes on an idle GPU machine):
#   1. the CUDA test modules (copy stream, events, pinned store, cache, ELB) - skipped elsewhere;
#   2. one end-to-end specter run per tiny architecture on hardware=cuda, with the greedy
#      lossless check on, and offload_ar for comparison;
#   3. the emulated-vs-real link sanity numbers land in results/gpu_check/*/env.json.
# Usage: bash scripts/gpu_check.sh [output_dir]    (needs: pip install -c constraints.txt -e ".[test]")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results/gpu_check}"
python - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False (install a CUDA build of torch 2.13.0)")
print("GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
python -m pytest -q -m gpu tests/gpu
for model in tiny_qwen tiny_dsv2 tiny_phi; do
  for method in offload_ar specter; do
    python run.py model=$model method=$method memory=low hardware=cuda num_prompts=2 max_new_tokens=48 \
      verify_lossless=$([ $method = specter ] && echo true || echo false) \
      output_dir="$OUT/$model-$method" progress=false
  done
done
echo "gpu_check: all passed; records under $OUT/"
