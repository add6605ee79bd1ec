#!/usr/bin/env bash
# Regenerate every result and figure this machine can produce, from one script.
#   CPU machine: tiny models (trained briefly here), hardware=emulated.
#   GPU machine: HARDWARE=cuda MODELS="dsv2 qwen15moe phi35moe" bash scripts/reproduce_all.sh
# Every step writes resumable run folders under results/; rerun to continue after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
HARDWARE="${HARDWARE:-emulated}"
MODELS="${MODELS:-tiny_dsv2 tiny_qwen tiny_phi}"
TRAINED="${TRAINED:-true}"
if [[ "$MODELS" == *tiny_* && "$TRAINED" == true ]]; then
  for m in $MODELS; do
    [ -f "${SPECTER_HOME:-$HOME/.cache/specter}/models/$m-trained/specter_trained.json" ] || python initialization/train_tiny.py "$m"
  done
fi
extra=(); [[ "$MODELS" == *tiny_* ]] && extra+=("model.trained=$TRAINED")
for m in $MODELS; do
  for mem in high low; do
    python run.py experiment=k_sweep model=$m memory=$mem hardware=$HARDWARE "${extra[@]}" \
      output_dir=results/k_sweep/$m-$mem-$HARDWARE
    for method in target_only offload_ar specter; do
      hw=$HARDWARE; [ $method = target_only ] && [ $HARDWARE = emulated ] && hw=cpu
      python run.py experiment=main model=$m memory=$mem method=$method hardware=$hw "${extra[@]}" \
        k_profile=results/k_sweep/$m-$mem-$HARDWARE/k_profile.json \
        output_dir=results/main/$m-$mem-$method
    done
  done
done
if [[ "$HARDWARE" == emulated ]]; then
  python scripts/bench_methods.py --suite prefetch --out results/bench
  python scripts/bench_verify.py --out results/bench/verify_schedule.csv
fi
python make_figures.py --results results --figures figures
