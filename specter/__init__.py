"""Specter: fast single-GPU MoE inference with offloaded experts and a shared-instance INT4 draft."""

import logging as _logging

# Optional third-party extensions (torchao kernels for other CUDA versions, torch pytree notices)
# log at import time; they say nothing about Specter's work.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

__version__ = "0.1.0"
