#!/usr/bin/env bash
# GPU checks in one call (about 6-8 minutes on an idle GPU machine; each step prints its time):
#   1. the CUDA test modules (copy stream, events, pinned store, cache, ELB, the compiled Triton
#      draft MoE at the real expert shapes, no host sync / CUDA-graph capture, kernel selection),
#      and the Triton interpreter grid run compiled on the GPU (tests/test_triton_moe.py);
#   2. the draft-kernel benchmark at the real models' expert shapes, decode and prefill T
#      -> $OUT/draft_kernel.csv (Figs. 10/11: triton, torch, unfused, FP16 loop);
#   3. one end-to-end run per tiny architecture on hardware=cuda: specter with the greedy
#      lossless check on, offload_ar for comparison; env.json must record draft_kernel=triton;
#   4. Marlin (comparison backend), only if gptqmodel's extension loads within $MARLIN_TIMEOUT s
#      (default 150; 0 skips): its test and $OUT/draft_kernel_marlin.csv. Never fails the check.
# Usage: bash scripts/gpu_check.sh [output_dir]    (needs: pip install -c constraints.txt -e ".[test,gpu]")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-results/gpu_check}"
MARLIN_TIMEOUT="${MARLIN_TIMEOUT:-150}"
mkdir -p "$OUT"
step() { echo "== gpu_check [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }

python - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check: torch.cuda.is_available() is False (install a CUDA build of torch 2.13.0)")
try:
    import triton
except ImportError:
    sys.exit("gpu_check: triton is not installed (pip install -e '.[gpu]')")
print("GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__)
PY

step "1. CUDA tests + the Triton grid compiled"
python -m pytest -q -m gpu tests/gpu
python -m pytest -q tests/test_triton_moe.py tests/test_kernel_select.py

step "2. draft kernel benchmark (real expert shapes)"
python scripts/bench_draft_kernel.py --device cuda --reps 10 "$OUT/draft_kernel.csv"

step "3. end-to-end runs on hardware=cuda"
for model in tiny_qwen tiny_dsv2 tiny_phi; do
  for method in offload_ar specter; do
    python run.py model=$model method=$method memory=low hardware=cuda num_prompts=2 max_new_tokens=48 \
      verify_lossless=$([ $method = specter ] && echo true || echo false) \
      output_dir="$OUT/$model-$method" progress=false
  done
done
python - "$OUT" <<'PY'
import json
import sys
from pathlib import Path

for env in sorted(Path(sys.argv[1]).glob("*-specter/env.json")):
    choice = json.loads(env.read_text()).get("draft_kernel")
    if choice is None:
        sys.exit(f"gpu_check: {env} records no draft_kernel")
    selected = choice.get("selected") if isinstance(choice, dict) else choice
    print(f"{env.parent.name}: draft_kernel {choice}")
    if selected != "triton":
        sys.exit(f"gpu_check: {env.parent.name} ran draft_kernel={selected}, expected triton")
PY

step "4. Marlin (optional comparison)"
if [[ "$MARLIN_TIMEOUT" != 0 ]] && timeout "$MARLIN_TIMEOUT" python -c "
import sys, torch
from specter.kernels.marlin_moe import marlin_unavailable
reason = marlin_unavailable(torch.device('cuda'), torch.float16)
sys.exit(f'marlin: {reason}' if reason else 0)"; then
  SPECTER_TEST_MARLIN=1 python -m pytest -q tests/gpu/test_gpu_triton.py -k marlin || echo "gpu_check: marlin test FAILED (not fatal)"
  python scripts/bench_draft_kernel.py "$OUT/draft_kernel_marlin.csv" --device cuda --reps 10 --dims \
    --only marlin triton || echo "gpu_check: marlin benchmark FAILED (not fatal)"
else
  echo "gpu_check: Marlin skipped (unavailable, or its build took over ${MARLIN_TIMEOUT}s)"
fi
step "done"
echo "gpu_check: all passed; records under $OUT/"
