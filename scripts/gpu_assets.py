"""The device's carried SPECTER_HOME (scripts/gpu_prepare.sh): tiny_phi and the GPTQ draft of the
GPTQ run gpu_check.sh makes on it, built here, where gptqmodel is installed.

The draft archive is keyed by the checkpoint's digest and the calibration tokens, so the device finds
it only for the same checkpoint, tokenizer and calibration prompts: the checkpoint travels with it,
and `GPTQ_RUN` is the one list of overrides both sides use.

    SPECTER_HOME=.gpu/home python -m scripts.gpu_assets
"""

from __future__ import annotations

import sys

GPTQ_RUN = ("model=tiny_phi", "method=specter", "method.quant=gptq", "memory=low", "num_prompts=2",
            "max_new_tokens=48")  # gpu_check.sh step 6 runs exactly these on hardware=cuda


def main(argv: list[str] | None = None) -> int:
    from specter.assembly.compose import compose
    from specter.assembly.config import effective_K
    from specter.assembly.runtime import build_runtime, gptq_draft_for, method_spec, model_checkpoint
    from specter.paths import specter_home

    if "--print-overrides" in (argv if argv is not None else sys.argv[1:]):
        print(" ".join(GPTQ_RUN))
        return 0
    cfg = compose([*GPTQ_RUN, "hardware=cpu"])
    checkpoint = model_checkpoint(cfg)
    rt = build_runtime(method_spec(cfg), checkpoint, K=effective_K(cfg))
    try:
        _, info = gptq_draft_for(method_spec(cfg), rt, checkpoint)
    finally:
        rt.close()
    print(f"gpu_assets: {checkpoint} and its GPTQ draft {info['draft_archive']} "
          f"({'cached' if info.get('cached') else 'built'}) in SPECTER_HOME={specter_home()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
