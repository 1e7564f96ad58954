"""torchtitan 0.2.2 on a machine without an accelerator: what it needs there, and only there.

spec.py calls `apply()` when `torch.accelerator.is_available()` is false, before torchtitan
picks its device (Trainer.__init__ imports `[experimental] custom_import` first); on a GPU
nothing here runs. Each patch carries its reason:

- the device: torchtitan/tools/utils.py takes `_get_available_device_type() or "cuda"`,
  "cuda" on a CPU, and Trainer then calls torch.cuda.set_device. Its modules copied the
  name at import; each copy becomes "cpu", and the device module a stand-in (`CPUDevice`)
  that answers what torchtitan asks of one;
- the barrier before the first step's timeout change passes
  `device_ids=[device_module.current_device()]`: torch.cpu's is the string "cpu", which
  barrier refuses; the stand-in's is 0, which gloo ignores;
- the exit: Trainer.train's rank 0 sleeps 2 s while the others destroy the process group,
  and gloo ranks that leave while another is busy abort at exit in some launches; a
  barrier first lets them leave together.

FSDP2's gradient reduction under gloo (no PREMUL_SUM) needs no patch: spec.parallelize
asks FSDP2 for plain sums there.

Imports from stacklm: nothing.
"""

import os
import resource
import sys
import types

import torch
import torch.distributed as dist


class CPUDevice:
    """torch.cuda's device API as torchtitan calls it, for the CPU."""

    @staticmethod
    def set_device(device):
        pass  # one CPU: nothing to select

    @staticmethod
    def current_device() -> int:
        return 0  # an int, as barrier's device_ids takes

    @staticmethod
    def synchronize():
        pass  # CPU kernels finish before they return

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"  # no peak-FLOPs entry: torchtitan's MFU assumes its default chip

    @staticmethod
    def get_device_properties(device=None):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # bytes of RAM
        return types.SimpleNamespace(total_memory=memory)

    @staticmethod
    def memory_stats(device=None) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats():
        pass  # a process's peak RSS cannot be reset: the log shows the peak so far

    @staticmethod
    def empty_cache():
        pass  # no caching allocator on the CPU


def apply():
    """Patch torchtitan (importing it if need be) for a CPU-only machine; once."""
    import torchtitan.tools.utils  # the device's origin: modules imported later copy from it

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "torchtitan":
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = CPUDevice
    if not getattr(dist.destroy_process_group, "after_barrier", False):
        dist.destroy_process_group = barrier_first(dist.destroy_process_group)


def barrier_first(destroy):
    def destroy_process_group(group=None):
        if group is None and dist.is_initialized():
            dist.barrier()  # every rank leaves together (see the module's docstring)
        destroy(group)
    destroy_process_group.after_barrier = True
    return destroy_process_group
