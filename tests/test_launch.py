"""launch.py's choices for `auto`: bf16 where the CPU computes it in hardware (read from its
flags, checked here against /proc/cpuinfo texts of the kinds the kernel writes), fp32 on any
other CPU, bf16 on a GPU with bf16 tensor cores (Ampere on) and fp32 on an older one; an
explicit knob wins; the banner says what was chosen and why."""

import types

import pytest
import torch

import config
import optim
from model import Transformer
from plumbing import launch, log, overrides

# /proc/cpuinfo as Linux writes it: a block per core, x86's `flags`, Arm's `Features`.
ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd crc32 atomics\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("cpuinfo, native", [(ZEN4, True), (ZEN3, False),
                                              (SAPPHIRE_RAPIDS, True), (GRAVITON3, True),
                                              (GRAVITON2, False), (ZEN3 + "\n" + ZEN3, False),
                                              ("model name\t: avx512_bf16 inside\n", False)])
def test_bf16_in_hardware_is_read_from_the_cpus_flags(tmp_path, cpuinfo, native):
    """Only the flags lines count (a model name that mentions a flag does not)."""
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    assert launch.cpu_computes_bf16(tmp_path / "cpuinfo") is native


def test_without_proc_cpuinfo_the_cpu_counts_as_having_no_bf16(tmp_path):
    assert launch.cpu_computes_bf16(tmp_path / "absent") is False


# A GPU as torch.cuda describes it: (name, compute capability).
H100, A100, T4, V100 = ("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA A100-SXM4-80GB", (8, 0)), \
    ("Tesla T4", (7, 5)), ("Tesla V100-SXM2-16GB", (7, 0))


@pytest.mark.parametrize("gpu, native, want", [
    (None, False, ("no", "auto: this CPU has no bf16 arithmetic")),
    (None, True, ("bf16", "auto: this CPU computes bf16 natively")),
    (H100, False, ("bf16", "auto: NVIDIA H100 80GB HBM3 (compute capability 9.0) computes bf16")),
    (A100, False, ("bf16", "auto: NVIDIA A100-SXM4-80GB (compute capability 8.0) computes bf16")),
    (T4, True, ("no", "auto: Tesla T4 (compute capability 7.5) has no bf16 tensor cores, which "
                      "GPUs have from Ampere (8.0) on")),
    (V100, True, ("no", "auto: Tesla V100-SXM2-16GB (compute capability 7.0) has no bf16"))])
def test_auto_precision_is_what_this_machine_computes_fastest(monkeypatch, gpu, native, want):
    """A GPU stands in by its name and compute capability, as torch.cuda reports them: a T4
    or a V100 (a free notebook's GPU) trains in fp32, as bf16 there is emulated."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    if gpu is not None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu[0])
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu[1])
    monkeypatch.setattr(launch, "cpu_computes_bf16", lambda: native)
    precision, why = launch.mixed_precision(config.tiny())
    assert (precision, why[:len(want[1])]) == want
    for explicit in ("no", "bf16"):  # an explicit knob wins, whatever the machine
        chosen = overrides.apply_overrides(config.tiny(), {"mixed_precision": explicit})
        assert launch.mixed_precision(chosen) == (explicit, "the config's mixed_precision")


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_compiles_on_a_gpu_and_for_a_long_cpu_run_and_an_explicit_knob_wins(monkeypatch,
                                                                                   cuda):
    """On a CPU, auto compiles from CPU_COMPILE_MIN_STEPS steps on (tiny's 300 stay eager,
    as measured), counted to where the run stops, not to its schedule's end; on a GPU
    always; an explicit knob wins either way."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for steps in (300, launch.CPU_COMPILE_MIN_STEPS - 1, launch.CPU_COMPILE_MIN_STEPS, 38_147):
        cfg = overrides.apply_overrides(config.tiny(), {"total_steps": "38147",
                                                     "stop_at_step": str(steps)})
        assert launch.use_compile(cfg)[0] is (cuda or steps >= launch.CPU_COMPILE_MIN_STEPS)
        for explicit, want in (("true", True), ("false", False)):
            chosen = overrides.apply_overrides(cfg, {"compile_model": explicit})
            assert launch.use_compile(chosen) == (want, "the config's compile_model")


def test_the_banner_says_what_auto_chose_and_why(monkeypatch):
    """The hardware line names the precision and compilation in use, each with its reason."""
    monkeypatch.setattr(launch, "cpu_computes_bf16", lambda: True)
    cfg = config.tiny()
    precision, why = launch.mixed_precision(cfg)
    accelerator = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"),
                                        distributed_type=types.SimpleNamespace(value="NO"),
                                        mixed_precision=precision)
    hardware = log.hardware(accelerator, False, launch.use_compile(cfg), why)
    facts = log.RunFacts(hardware, "abc", [], {cfg.data_dir: 1.0}, {cfg.data_dir: 10})
    model = Transformer(cfg.model)
    text = log.banner(cfg, facts, model, optim.build_optimizers(model, cfg), "schedule",
                      log.model_flops(cfg))
    assert "precision bf16 (auto: this CPU computes bf16 natively; mixed_precision=auto wins " \
           "over a launch config's), compile False (auto: a CPU run of 300 steps, too short to " \
           "pay back compiling (500+))" in text
