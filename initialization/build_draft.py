"""Build (or verify) a model's GPTQ INT4 draft ahead of time, with the run's own configuration.

    python initialization/build_draft.py model=dsv2 hardware=cuda          # real model, on a GPU
    python initialization/build_draft.py model=tiny_qwen model.trained=true

Calibration prompts come from the configured datasets (method.calibration_prompts of them). The
packed draft is cached under $SPECTER_HOME/drafts/<model>/ with a sha256 file; runs with
method=specter method.quant=gptq load it from there (and refuse a corrupt archive).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    from specter.assembly.compose import compose
    from specter.assembly.errors import USER_ERRORS, report
    from specter.assembly.runtime import build_runtime, gptq_draft_for, method_spec, model_checkpoint

    cfg = compose(["method=specter", "method.quant=gptq", *args])
    try:
        checkpoint = model_checkpoint(cfg)
        rt = build_runtime(method_spec(cfg), checkpoint)
        try:
            layers, info = gptq_draft_for(method_spec(cfg), rt, checkpoint)
        finally:
            rt.close()
    except USER_ERRORS as err:
        report(err)
        return 2
    nbytes = sum(d.nbytes for d in layers.values())
    print(f"{cfg.model.name}: GPTQ draft {'verified in' if info['cached'] else 'written to'} "
          f"{info['draft_archive']} ({nbytes / 2**20:.1f} MB packed, {len(layers)} MoE layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
