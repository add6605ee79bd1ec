#!/usr/bin/env bash
# Regenerate every result, figure and table of the paper that this machine can produce.
#
#   CHECK=1 QUICK=1 bash scripts/reproduce_all.sh    # preflight (seconds): what will run, on what data, how long
#   QUICK=1 bash scripts/reproduce_all.sh            # the whole pipeline, shortened (see QUICK below); offline
#   bash scripts/reproduce_all.sh                    # full protocol, trained tiny models, emulated link
#   DRY_RUN=1 QUICK=1 bash scripts/reproduce_all.sh  # print every step's command; run nothing
#   HARDWARE=cuda MODELS="dsv2 qwen15moe phi35moe" bash scripts/reproduce_all.sh   # the paper's setup
#   LAUNCHER=slurm HARDWARE=cuda MODELS="dsv2 qwen15moe phi35moe" bash scripts/reproduce_all.sh
#
# Steps: check the datasets -> train the tiny models (tiny only, once) -> K sweep per model and tier
# -> the main grid (models x tiers x methods) -> batching -> planner trace -> benchmarks (draft
# kernel, verification schedule, prefetch ablation) -> make_figures.py. The plan and every decision
# are made by specter/reproduce/ (python -m specter.reproduce); this script only sets the defaults.
#
# Datasets: the check runs first and decides. The runs use the requested datasets that are present
# (assets folder, or a copy the loader has without a network); DATASET is narrowed to them, said once
# at the start and in the summary, and given to every run (its config.yaml and provenance.json
# record it). When none is present the script stops with one message saying where the files go.
#
# Failures: a step that needs the output of a failed (or skipped) step is skipped "because <step>
# failed", not run. The closing summary is a table (step, result and why, duration), each error once,
# and a line per figure: drawn from this run's results, or why not (the shipped reference has it);
# it is also written to <RESULTS>/reproduce_summary.md.
#
# Resumable: a step counts as done when results/logs/<step>.done holds its command AND its outputs
# exist and are valid (a deleted or incomplete result folder is run again); FORCE=1 reruns all. Each
# step's output goes to results/logs/<step>.log, its time to results/logs/timings.json (CHECK=1 uses
# those). TERM/INT/HUP stop the running step (its whole process group) before the script exits.
#
# Settings (environment variables):
#   QUICK=1        1 prompt x 1 repeat per dataset, 32 new tokens, K in {4,8,16} swept on the low
#                  tier only, the staging ablation on the first model's low tier, batch sizes {1,2,4}
#                  over 4 prompts of one dataset (HumanEval when present; the trace and the prefetch
#                  ablation too); results in results/quick, figures in figures/quick. Timed: 22 min on
#                  2 cores offline with the three bundled datasets once the tiny models are trained
#                  (3-5 min each, once); CHECK=1 QUICK=1 prints the estimate for this machine.
#   REFERENCE=1    the shipped results/reference's protocol: 5 prompts x 2 timing repeats per dataset,
#                  128 new tokens after a 64-token warm-up; K profiled at every tier over {4,8,16,32,48,64,96}
#                  for Specter and SpecMoEOff alike (2 prompts per dataset x 128 tokens); B in {1,...,32}
#                  over 32 prompts of every dataset; the staging ablation on the first model's low tier;
#                  results in results/reference_run (ARTIFACT.md section 5 gives its time)
#   JOBS=2         run two measuring steps at a time (default 1). The emulated link's copies are waits, so
#                  a step leaves most of a core idle; each record re-times the link from its own probe and a
#                  cell interleaves its methods, so a neighbour slows them alike. The dataset check, training,
#                  the timed benchmarks and the figures still run alone
#   CHECK=1        preflight: the plan, its data and a time estimate; runs nothing, writes nothing
#   DRY_RUN=1      print every step's command; DRY_FAIL="<step> ..." also shows what their failure skips
#   MODELS         default "tiny_dsv2 tiny_qwen tiny_phi"
#   TIERS          default "high low"
#   HARDWARE       emulated (default; target_only runs on hardware=cpu: it moves no experts) | cpu | cuda
#   METHODS        default: every conf/method/*.yaml, except llamacpp unless llama_cpp is importable
#                  and vllm unless its env (scripts/setup_vllm.sh) exists and HARDWARE=cuda (their runners need those
#                  packages; transformers needs only core dependencies and is included)
#   BATCH_MODELS   default: the MODELS that mirror DeepSeek-V2-Lite and Qwen1.5-MoE (the paper's)
#   BATCH_METHODS  default: specter mo_sm specmoeoff transformers (those in METHODS)
#   DATASET        default all (C4, WT, HE, GK, GP), narrowed to those present; ASSETS=<dir> sets the
#                  runs' assets_dir (default: $SPECTER_ASSETS or assets)
#   TRAINED        true (default): tiny models use their trained variants (python -m initialization.train_tiny)
#   LAUNCHER       unset: one step per run, here | slurm: the grid as Hydra multiruns submitted with
#                  hydra/launcher=slurm (conf/hydra/launcher/slurm.yaml, hydra-submitit-launcher) |
#                  local: the same multiruns on this machine through submitit (hydra/launcher=local)
#   RESULTS FIGURES LOGS   output folders (defaults: results, figures, results/logs; QUICK: results/quick,
#                  figures/quick, results/logs)
#   PYTHON         default python; FORCE=1 reruns finished steps
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m specter.reproduce
