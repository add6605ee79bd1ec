"""reproduce_all: the step plan, the decisions about data and failed steps, and the runner.

`scripts/reproduce_all.sh` runs `python -m specter.reproduce`; settings come from the environment
(documented at the top of that script). One module per job:

    settings   the environment read once: what to run, where, with what (methods available here)
    protocol   the protocol sizes of each experiment (prompts, repeats, K values, batch sizes)
    datasets   which requested datasets are present, and the one decision that narrows DATASET
    plan       the steps: each one's command, the steps it needs, the outputs that prove it done
    outputs    whether a step's outputs exist and are valid (not its marker alone)
    estimate   how long the plan takes on this machine (measured step times)
    execute    running the steps: logs, markers, skipping dependents, stopping the child on TERM/INT
    report     the closing summary table and which figures came from this run's own results
"""
