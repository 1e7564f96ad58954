"""stacklm inside torchtitan 0.2.2 (docs/torchtitan.md): spec.py registers the TrainSpec
"stacklm", cpu.py lets torchtitan run on a machine without an accelerator.

Imports from stacklm: nothing.
"""
