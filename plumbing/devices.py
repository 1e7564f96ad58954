"""The devices a run trains on: a CUDA GPU, an Apple GPU (MPS) or the CPU, and which one
--device=auto takes (nanochat's order). train.py (through launch) and sample.py share it.

Imports from stacklm: nothing. It takes a config object.
"""

import torch

# The devices a run may train on, in the order --device=auto tries them (nanochat's), with
# the test for each and what it is called in a refusal.
DEVICES = {"cuda": (lambda: torch.cuda.is_available(), "CUDA GPU"),
           "mps": (lambda: torch.backends.mps.is_available(), "Apple GPU (MPS)"),
           "cpu": (lambda: True, "CPU")}


def device_type(cfg) -> str:
    """The device type a run trains on: --device, or for auto a CUDA GPU, else an Apple GPU,
    else the CPU. One the machine lacks is refused in one line."""
    if cfg.device == "auto":
        return next(name for name, (present, _) in DEVICES.items() if present())
    present, what = DEVICES[cfg.device]
    if not present():
        raise ValueError(f"device={cfg.device}: this machine has no {what}; use --device=auto "
                         f"(it picks what the machine has) or --device=cpu")
    return cfg.device
