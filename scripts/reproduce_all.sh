#!/usr/bin/env bash
# Regenerate every result, figure and table of the paper that this machine can produce.
#
#   bash scripts/reproduce_all.sh                    # full protocol, trained tiny models, emulated link
#   QUICK=1 bash scripts/reproduce_all.sh            # the same pipeline, shortened (see QUICK below)
#   DRY_RUN=1 QUICK=1 bash scripts/reproduce_all.sh  # print every step's command; run nothing
#   HARDWARE=cuda MODELS="dsv2 qwen15moe phi35moe" bash scripts/reproduce_all.sh   # the paper's setup
#   LAUNCHER=slurm HARDWARE=cuda MODELS="dsv2 qwen15moe phi35moe" bash scripts/reproduce_all.sh
#
# Steps: train the tiny models (tiny only, once) -> check the datasets -> K sweep per model and tier
# -> the main grid (models x tiers x methods) -> batching -> planner trace -> benchmarks (draft
# kernel, verification schedule, prefetch ablation) -> make_figures.py.
#
# Resumable: each finished step leaves results/logs/<step>.done holding its command and is skipped
# when rerun with the same command (FORCE=1 reruns everything); run folders resume their records
# themselves. Each step's output goes to results/logs/<step>.log. A failed step does not stop the
# rest; the closing summary lists what ran, was skipped or failed, and where the figures are.
#
# Settings (environment variables):
#   QUICK=1        1 prompt x 2 repeats per dataset, 32 new tokens, K in {4,8,16} swept on the low
#                  tier only, batch sizes {1,2,4} over 4 prompts; results in results/quick, figures
#                  in figures/quick.
#                  An estimate: 30-40 min on 2 CPU cores with every method of conf/method, once the
#                  tiny models are trained (training: 5 min per model, once)
#   MODELS         default "tiny_dsv2 tiny_qwen tiny_phi"
#   TIERS          default "high low"
#   HARDWARE       emulated (default; target_only runs on hardware=cpu: it moves no experts) | cpu | cuda
#   METHODS        default: every conf/method/*.yaml, except llamacpp unless llama_cpp is importable
#                  and vllm unless its env (scripts/setup_vllm.sh) exists and HARDWARE=cuda (their runners need those
#                  packages; transformers needs only core dependencies and is included)
#   BATCH_MODELS   default: the MODELS that mirror DeepSeek-V2-Lite and Qwen1.5-MoE (the paper's)
#   BATCH_METHODS  default: specter mo_sm specmoeoff transformers (those in METHODS)
#   DATASET        default all (C4, WT, HE, GK, GP); ASSETS=<dir> sets the runs' assets_dir
#   TRAINED        true (default): tiny models use their briefly trained variants; TRAIN_MINUTES=5
#   LAUNCHER       unset: one step per run, here | slurm: the grid as Hydra multiruns submitted with
#                  hydra/launcher=slurm (conf/hydra/launcher/slurm.yaml, hydra-submitit-launcher) |
#                  local: the same multiruns on this machine through submitit (hydra/launcher=local)
#   RESULTS FIGURES LOGS   output folders (defaults: results, figures, results/logs; QUICK: results/quick,
#                  figures/quick, results/logs)
#   PYTHON         default python; FORCE=1 reruns finished steps; DRY_RUN=1 prints the plan only
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK="${QUICK:-0}"; DRY_RUN="${DRY_RUN:-0}"; FORCE="${FORCE:-0}"
PY="${PYTHON:-python}"
HARDWARE="${HARDWARE:-emulated}"
MODELS="${MODELS:-tiny_dsv2 tiny_qwen tiny_phi}"
TIERS="${TIERS:-high low}"
DATASET="${DATASET:-all}"
TRAINED="${TRAINED:-true}"
TRAIN_MINUTES="${TRAIN_MINUTES:-5}"
LAUNCHER="${LAUNCHER:-}"
if [[ "$QUICK" == 1 ]]; then
  RESULTS="${RESULTS:-results/quick}"; FIGURES="${FIGURES:-figures/quick}"; MODE=quick
  PROTOCOL=(num_prompts=1 repeats=2 max_new_tokens=32 warmup_tokens=8)
  SWEEP=(num_prompts=1 repeats=1 max_new_tokens=32 warmup_tokens=8 "k_sweep.values=[4,8,16]")
  SWEEP_TIERS="low"
  BATCH=(num_prompts=4 max_new_tokens=32 warmup_tokens=8 "batch.sizes=[1,2,4]")
else
  RESULTS="${RESULTS:-results}"; FIGURES="${FIGURES:-figures}"; MODE=full
  PROTOCOL=(); SWEEP=(); SWEEP_TIERS="$TIERS"; BATCH=()
fi
LOGS="${LOGS:-results/logs}"
[[ -n "${ASSETS:-}" ]] && PROTOCOL+=("assets_dir=$ASSETS") && SWEEP+=("assets_dir=$ASSETS") && BATCH+=("assets_dir=$ASSETS")
SPECTER_HOME="${SPECTER_HOME:-$HOME/.cache/specter}"

# ---------------------------------------------------------------- methods
if [[ -z "${METHODS:-}" ]]; then
  available=$("$PY" - "$HARDWARE" <<'EOF'
import importlib.util, os, pathlib, sys
names = sorted(p.stem for p in pathlib.Path("conf/method").glob("*.yaml"))
home = pathlib.Path(os.environ.get("SPECTER_HOME", pathlib.Path.home() / ".cache" / "specter"))
vllm_python = pathlib.Path(os.environ.get("SPECTER_VLLM_PYTHON") or home / "venvs" / "vllm" / "bin" / "python")
available = {"llamacpp": importlib.util.find_spec("llama_cpp") is not None,  # engine baselines with their own
             "vllm": vllm_python.exists()}                                  # packages (vLLM: its own env)
keep = [n for n in names if available.get(n, True)]
if sys.argv[1] != "cuda" and "vllm" in keep:
    keep.remove("vllm")  # vLLM's CPU weight offload serves a GPU
first = [n for n in ("target_only", "offload_ar") if n in keep]
print(" ".join(first + [n for n in keep if n not in first]))
EOF
  )
  METHODS="$available"
fi
is_tiny() { [[ "$1" == tiny_* ]]; }
trained_opt() { if is_tiny "$1"; then echo "model.trained=$TRAINED"; fi; }
# Methods that place every weight themselves (no offloading through our link) run on the plain CPU
# when the others use the emulated link.
method_hw() {
  if [[ "$HARDWARE" == emulated && "$1" =~ ^(target_only|transformers|llamacpp|vllm)$ ]]; then echo cpu; else echo "$HARDWARE"; fi
}
if [[ -z "${BATCH_MODELS:-}" ]]; then
  BATCH_MODELS=""; for m in $MODELS; do [[ "$m" =~ dsv2|qwen ]] && BATCH_MODELS+="$m "; done
fi
BATCH_METHODS="${BATCH_METHODS:-specter mo_sm specmoeoff transformers}"
k_profile() {  # the K profile a specter run of model $1, tier $2 uses
  local tier="$2"; [[ "$QUICK" == 1 ]] && tier=low
  echo "$RESULTS/k_sweep/$1-$tier-$HARDWARE/k_profile.json"
}

# ---------------------------------------------------------------- the plan
NAMES=(); CMDS=(); NOTES=()
quote() {  # shell-quote each argument, leaving plain ones readable
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./=:,@+%-]+$ ]]; then out+=("$a"); else out+=("'${a//\'/\'\\\'\'}'"); fi
  done
  echo "${out[*]}"
}
add() {  # add NAME CMD... (the command is stored shell-quoted)
  local name="$1"; shift
  NAMES+=("$MODE.$name"); CMDS+=("$(quote "$@")")
}
note() { NOTES+=("$*"); }

if [[ "$TRAINED" == true ]]; then
  for m in $MODELS; do
    is_tiny "$m" || continue
    if [[ -f "$SPECTER_HOME/models/$m-trained/specter_trained.json" && "$FORCE" != 1 ]]; then
      note "train-$m: already trained ($SPECTER_HOME/models/$m-trained)"
    else
      add "train-$m" "$PY" initialization/train_tiny.py "$m" --minutes "$TRAIN_MINUTES"
    fi
  done
fi
assets_args=(); [[ -n "${ASSETS:-}" ]] && assets_args=(--assets "$ASSETS")
add "datasets" "$PY" -m initialization.prepare_datasets --datasets "$DATASET" "${assets_args[@]}"

if [[ -z "$LAUNCHER" ]]; then
  for m in $MODELS; do
    for tier in $SWEEP_TIERS; do
      add "k_sweep-$m-$tier" "$PY" run.py experiment=k_sweep model="$m" memory="$tier" hardware="$HARDWARE" \
        dataset="$DATASET" $(trained_opt "$m") "${SWEEP[@]}" output_dir="$RESULTS/k_sweep/$m-$tier-$HARDWARE"
    done
  done
  for m in $MODELS; do
    for tier in $TIERS; do
      for method in $METHODS; do
        # Specter and MoE-Spec (verification-time budgeting on Specter) share the tier's profiled K
        extra=(); [[ "$method" == specter || "$method" == moe_spec ]] && extra=(k_profile="$(k_profile "$m" "$tier")")
        add "main-$m-$tier-$method" "$PY" run.py experiment=main model="$m" memory="$tier" method="$method" \
          hardware="$(method_hw "$method")" dataset="$DATASET" $(trained_opt "$m") "${PROTOCOL[@]}" "${extra[@]}" \
          output_dir="$RESULTS/main/$m-$method-$tier"
      done
    done
  done
else
  # Hydra multiruns: one per kind of job (tiny and real models apart: only tiny ones take model.trained)
  launcher="hydra/launcher=$LAUNCHER"
  tiny=""; real=""
  for m in $MODELS; do if is_tiny "$m"; then tiny+="${tiny:+,}$m"; else real+="${real:+,}$m"; fi; done
  others=""; profiled=""  # profiled: the methods that take the tier's K profile (Specter and MoE-Spec)
  for method in $METHODS; do
    case "$method" in
      specter|moe_spec) profiled+="${profiled:+,}$method" ;;
      target_only) ;;
      *) others+="${others:+,}$method" ;;
    esac
  done
  tiers_csv=$(echo $TIERS | tr ' ' ','); sweep_csv=$(echo $SWEEP_TIERS | tr ' ' ',')
  profile_tier='${memory.name}'; [[ "$QUICK" == 1 ]] && profile_tier=low
  for group in tiny real; do
    models="${!group}"; [[ -z "$models" ]] && continue
    topt=(); [[ "$group" == tiny ]] && topt=(model.trained="$TRAINED")
    add "k_sweep-$group" "$PY" run.py -m "$launcher" experiment=k_sweep model="$models" memory="$sweep_csv" \
      hardware="$HARDWARE" dataset="$DATASET" "${topt[@]}" "${SWEEP[@]}" \
      'output_dir='"$RESULTS"'/k_sweep/${model.name}-${memory.name}-${hardware.name}'
    [[ -n "$profiled" ]] && add "main-$group-specter" "$PY" run.py -m "$launcher" experiment=main \
      model="$models" memory="$tiers_csv" method="$profiled" hardware="$HARDWARE" dataset="$DATASET" "${topt[@]}" \
      "${PROTOCOL[@]}" \
      'k_profile='"$RESULTS"'/k_sweep/${model.name}-'"$profile_tier"'-${hardware.name}/k_profile.json' \
      'output_dir='"$RESULTS"'/main/${model.name}-${method.name}-${memory.name}'
    [[ " $METHODS " == *" target_only "* ]] && add "main-$group-target_only" "$PY" run.py -m "$launcher" \
      experiment=main model="$models" memory="$tiers_csv" method=target_only hardware="$(method_hw target_only)" \
      dataset="$DATASET" "${topt[@]}" "${PROTOCOL[@]}" \
      'output_dir='"$RESULTS"'/main/${model.name}-${method.name}-${memory.name}'
    [[ -n "$others" ]] && add "main-$group-others" "$PY" run.py -m "$launcher" experiment=main model="$models" \
      memory="$tiers_csv" method="$others" hardware="$HARDWARE" dataset="$DATASET" "${topt[@]}" "${PROTOCOL[@]}" \
      'output_dir='"$RESULTS"'/main/${model.name}-${method.name}-${memory.name}'
  done
fi

if [[ -f conf/experiment/batch.yaml ]]; then
  for m in $BATCH_MODELS; do
    for method in $BATCH_METHODS; do
      [[ " $METHODS " == *" $method "* ]] || continue
      extra=(); [[ "$method" == specter ]] && extra=(k_profile="$(k_profile "$m" high)")
      add "batch-$m-$method" "$PY" run.py experiment=batch model="$m" memory=high method="$method" \
        hardware="$(method_hw "$method")" dataset="$DATASET" $(trained_opt "$m") "${BATCH[@]}" "${extra[@]}" \
        output_dir="$RESULTS/batch/$m-$method-high-$(method_hw "$method")"
    done
  done
else
  note "batch: conf/experiment/batch.yaml not found; Figs. 15/16 and Table 3 will be skipped"
fi
if grep -q "trace_windows" specter/harness/schema.py 2>/dev/null && [[ " $METHODS " == *" specter "* ]] \
   && [[ "$HARDWARE" != cuda ]]; then  # traces are host-timed: cpu and emulated links
  for m in $MODELS; do
    add "trace-$m" "$PY" run.py model="$m" memory=low method=specter hardware="$HARDWARE" dataset=humaneval \
      num_prompts=1 repeats=1 $(trained_opt "$m") k_profile="$(k_profile "$m" low)" method.trace_windows=true \
      output_dir="$RESULTS/trace/$m-specter-low"
  done
else
  note "trace: no method.trace_windows (or HARDWARE=cuda); the planner timeline (Figs. 8/9) will be skipped"
fi

untrained=(); [[ "$TRAINED" != true ]] && untrained=(--untrained)
TINY_MODELS=""; for m in $MODELS; do is_tiny "$m" && TINY_MODELS+="$m "; done
if [[ "$QUICK" == 1 ]]; then
  add "bench-draft-kernel" "$PY" scripts/bench_draft_kernel.py --quick --dtype float32 "$RESULTS/bench/draft_kernel.csv"
  bench_verify=(--memory low --K 4 8 16 --reps 3)
  bench_prefetch=(--memory low --num-prompts 1 --max-new-tokens 32)
else
  add "bench-draft-kernel" "$PY" scripts/bench_draft_kernel.py "$RESULTS/bench/draft_kernel.csv"
  bench_verify=(); bench_prefetch=()
fi
if [[ -n "$TINY_MODELS" ]]; then  # these two benchmarks drive the tiny models
  add "bench-verify" "$PY" scripts/bench_verify.py --models $TINY_MODELS "${bench_verify[@]}" --hardware "$HARDWARE" \
    "${untrained[@]}" --out "$RESULTS/bench/verify_schedule.csv"
  bench_datasets="$DATASET"; [[ "$DATASET" == all ]] && bench_datasets="c4,wikitext2,humaneval,gsm8k,gpqa"
  add "bench-prefetch" "$PY" scripts/bench_methods.py --suite prefetch --models $TINY_MODELS "${bench_prefetch[@]}" \
    --datasets "$bench_datasets" --hardware "$HARDWARE" "${untrained[@]}" --out "$RESULTS/bench"
else
  note "bench-verify, bench-prefetch: tiny models only (MODELS has none)"
fi
add "figures" "$PY" make_figures.py --results "$RESULTS" --figures "$FIGURES"

# ---------------------------------------------------------------- run it
TOTAL=${#NAMES[@]}
echo "reproduce_all ($MODE): $TOTAL steps; models: $MODELS; tiers: $TIERS; hardware: $HARDWARE; methods: $METHODS${LAUNCHER:+; launcher: $LAUNCHER}"
for n in "${NOTES[@]}"; do echo "  note: $n"; done
if [[ "$DRY_RUN" == 1 ]]; then
  for i in "${!NAMES[@]}"; do echo "[$((i + 1))/$TOTAL] ${NAMES[$i]}: ${CMDS[$i]% }"; done
  exit 0
fi
mkdir -p "$LOGS"
RAN=(); SKIPPED=(); FAILED=()
t_all=$SECONDS
for i in "${!NAMES[@]}"; do
  name="${NAMES[$i]}"; cmd="${CMDS[$i]% }"; log="$LOGS/$name.log"; done_file="$LOGS/$name.done"
  if [[ "$FORCE" != 1 && -f "$done_file" && "$(cat "$done_file")" == "$cmd" ]]; then
    echo "[$((i + 1))/$TOTAL] $name: finished earlier, skipped"
    SKIPPED+=("$name"); continue
  fi
  echo "[$((i + 1))/$TOTAL] $name: running (log: $log)"
  t0=$SECONDS
  { echo "\$ $cmd"; echo; } > "$log"
  if eval "$cmd" >> "$log" 2>&1; then
    echo "$cmd" > "$done_file"
    echo "    done in $((SECONDS - t0)) s"
    RAN+=("$name")
  else
    rc=$?
    echo "    FAILED (exit $rc) after $((SECONDS - t0)) s; last lines of $log:"
    tail -n 5 "$log" | sed 's/^/      /'
    FAILED+=("$name")
  fi
done
echo
echo "== summary ($MODE, $(( (SECONDS - t_all) / 60 )) min) =="
echo "ran:     ${#RAN[@]}${RAN:+  (${RAN[*]})}"
echo "skipped: ${#SKIPPED[@]} (finished earlier)"
echo "failed:  ${#FAILED[@]}"
for f in "${FAILED[@]}"; do echo "  $f: $LOGS/$f.log"; done
echo "results: $RESULTS/   logs: $LOGS/   figures: $FIGURES/ (index.md lists what was drawn or skipped)"
[[ ${#FAILED[@]} -eq 0 ]]
