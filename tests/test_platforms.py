"""Where users run it: Linux, macOS (its CPU or its Apple GPU) and Windows. Only Linux runs
the suite, so the others are faked here: the device torch reports, the platform's name, the
Unix-only modules gone. What each fake checks is the choice the code makes, and the line a
user reads."""

import ast
import dataclasses
import io
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import config
import model
import sample
from plumbing import checkpoint, cli, devices, launch, log
from tests.test_errors import run_cli

REPO = Path(__file__).resolve().parent.parent


def machine(monkeypatch, cuda: bool = False, mps: bool = False):
    """A machine with a CUDA GPU, an Apple GPU, both or neither, as torch reports them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


@pytest.mark.parametrize("cuda, mps, device", [(True, True, "cuda"), (True, False, "cuda"),
                                               (False, True, "mps"), (False, False, "cpu")])
def test_device_auto_takes_a_cuda_gpu_then_an_apple_gpu_then_the_cpu(monkeypatch, cuda, mps,
                                                                     device):
    machine(monkeypatch, cuda, mps)
    assert devices.device_type(config.tiny()) == device
    assert sample.checked_device("auto") == device
    assert devices.device_type(dataclasses.replace(config.tiny(), device="cpu")) == "cpu"


@pytest.mark.parametrize("device, what", [("cuda", "CUDA GPU"), ("mps", "Apple GPU (MPS)")])
def test_a_device_this_machine_lacks_is_one_line(monkeypatch, small_data_dir, tmp_path, capsys,
                                                 device, what):
    """Refused before anything is built: the Accelerator asks for the device first."""
    machine(monkeypatch)
    err = run_cli([f"--data_dir={small_data_dir}", f"--out_dir={tmp_path}",
                   f"--device={device}"], capsys)
    assert err == (f"error: device={device}: this machine has no {what}; use --device=auto (it "
                   f"picks what the machine has) or --device=cpu")
    assert not any(tmp_path.iterdir())


def test_an_apple_gpu_trains_fp32_eagerly_and_the_banner_says_why(monkeypatch):
    """fp32, as nanochat trains there (bf16 needs macOS 14, fp16 a loss scaler); torch.compile
    off (its MPS backend is a prototype); an explicit knob still wins."""
    machine(monkeypatch, mps=True)
    cfg = config.tiny()
    assert launch.mixed_precision(cfg) == ("no", "auto: an Apple GPU (MPS) trains in fp32, which "
                                           "every macOS computes; bf16 there needs macOS 14, "
                                           "and fp16 a loss scaler")
    assert launch.use_compile(cfg) == (False, "auto: an Apple GPU, where torch.compile's "
                                              "backend is a prototype")
    assert launch.mixed_precision(dataclasses.replace(cfg, mixed_precision="bf16"))[0] == "bf16"
    assert launch.use_compile(dataclasses.replace(cfg, compile_model="true"))[0] is True
    mps = torch.device("mps")
    assert log.device_name(mps) == "Apple GPU (MPS)"
    assert "what Metal holds for this process" in log.MEM_COLUMN["mps"]
    assert model.attention_backend(mps, has_seq_ids=True) == "sdpa_dense"  # flex is CUDA's


def test_an_apple_gpu_has_no_mfu_and_its_memory_is_metals(monkeypatch):
    """No peak FLOP/s is known for an Apple GPU, so MFU is n/a; its memory column and its
    capacity are what Metal reports (the driver's allocation, the recommended working set)."""
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * 2**30)
    mps = torch.device("mps")
    assert log.memory_gib(mps) == 3.0
    assert log.memory_capacity(mps) == (12.0, "this Apple GPU's 12.0 GiB (Metal's recommended "
                                              "working set)")
    assert log.peak_flops(log.device_name(mps)) is None


@pytest.mark.parametrize("device, platform, refused", [
    ("mps", "darwin", "an Apple GPU (MPS) trains on one process"),
    ("cpu", "win32", "a launched multi-process run needs Linux or macOS"),
    ("cuda", "win32", "a launched multi-process run needs Linux or macOS"),
    ("cpu", "darwin", None), ("cpu", "linux", None)])
def test_a_launched_run_where_it_cannot_work_is_refused(device, platform, refused):
    launch.check_platform(device, {"WORLD_SIZE": "1"}, platform)  # one process runs anywhere
    if refused is None:
        launch.check_platform(device, {"WORLD_SIZE": "2"}, platform)
        return
    with pytest.raises(ValueError) as error:
        launch.check_platform(device, {"WORLD_SIZE": "2"}, platform)
    assert str(error.value).startswith(refused)


def test_peak_memory_is_read_in_each_platforms_unit(monkeypatch):
    """ru_maxrss is KiB on Linux and bytes on macOS; Windows has no `resource` module, and
    its peak working set comes from psutil."""
    usage = types.SimpleNamespace(ru_maxrss=1000)
    fake = types.SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: usage)
    monkeypatch.setitem(sys.modules, "resource", fake)
    assert log.peak_resident_bytes("linux") == 1000 * 1024
    assert log.peak_resident_bytes("darwin") == 1000
    windows = types.SimpleNamespace(memory_info=lambda: types.SimpleNamespace(peak_wset=5000))
    monkeypatch.setattr(log.psutil, "Process", lambda: windows)
    monkeypatch.setitem(sys.modules, "resource", None)  # importing it would raise
    assert log.peak_resident_bytes("win32") == 5000


def test_peak_memory_on_linux_is_the_kernels_high_water_mark():
    """The real reading, against the kernel's own record of it (VmHWM, in kB)."""
    status = Path("/proc/self/status").read_text().splitlines()
    [hwm] = [int(line.split()[1]) for line in status if line.startswith("VmHWM:")]
    assert log.peak_resident_bytes() == pytest.approx(hwm * 1024, rel=0.05)


# What Windows lacks of the standard library, made unimportable or deleted. psutil is
# imported first: its Linux half uses `resource`, its Windows half does not.
WITHOUT_UNIX = ("import os, sys, psutil\n"
                "for name in ('resource', 'fcntl', 'termios', 'pwd', 'grp'):\n"
                "    sys.modules[name] = None\n"
                "del os.sysconf\n")


def test_every_command_imports_without_the_unix_only_modules():
    """Windows has no `resource`, `fcntl`, `termios`, `pwd`, `grp` or os.sysconf: the five
    commands still import, and the memory check still knows the machine's RAM."""
    code = WITHOUT_UNIX + ("import torch\n"
                           "import train, prepare, export, sample, report\n"
                           "from plumbing import log\n"
                           "print(log.memory_capacity(torch.device('cpu'))[1])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("this machine's "), result.stdout


def test_the_outcome_file_is_replaced_where_rename_will_not_overwrite(monkeypatch, tmp_path):
    """Windows' rename refuses an existing target: a second outcome must replace the first."""
    def windows_rename(self, target):
        if Path(target).exists():
            raise FileExistsError(f"cannot create {target}: it exists")
        return original(self, target)
    original = Path.rename
    monkeypatch.setattr(Path, "rename", windows_rename)
    monkeypatch.setenv(launch.OUTCOME_FILE, str(tmp_path / "outcome"))
    launch.record_outcome("stopped", 3, is_local_main=True)
    launch.record_outcome("finished", 8, is_local_main=True)
    assert (tmp_path / "outcome").read_text() == "finished 8\n"


def test_on_windows_the_commands_print_utf8_whatever_the_code_page(monkeypatch):
    """Windows writes a pipe or a file in its ANSI code page (cp1252 in the West), which has
    no → (the banner's sample line): printed as is, a run would end in a UnicodeEncodeError."""
    pipe = io.BytesIO()
    stdout = io.TextIOWrapper(pipe, encoding="cp1252")
    monkeypatch.setattr(sys, "stdout", stdout)
    cli.utf8_output("win32")
    print("sample ('def ' →): 16 × 256")
    stdout.flush()
    assert pipe.getvalue().decode("utf-8") == "sample ('def ' →): 16 × 256\n"


def unencoded_text_io(path: Path) -> list[str]:
    """The calls in `path` that read or write text without naming its encoding: read_text,
    write_text, and open or Path.open in a text mode."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        keywords = {k.arg: k.value for k in node.keywords}
        if name == "open":
            arguments = node.args[1:2] if isinstance(node.func, ast.Name) else node.args[:1]
            mode = keywords.get("mode", arguments[0] if arguments else None)
            binary = isinstance(mode, ast.Constant) and "b" in str(mode.value)
        if (name in ("read_text", "write_text") or name == "open" and not binary) \
                and "encoding" not in keywords:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return found


def test_every_text_file_is_read_and_written_as_utf8():
    """Windows reads and writes text in its ANSI code page unless told otherwise: a
    tokenizer_config.json, a model's config.json or report.md with a character past ASCII
    would be garbled or refused. Every text file stacklm touches names UTF-8."""
    files = [*REPO.glob("*.py"), *(REPO / "plumbing").glob("*.py"), *(REPO / "bench").glob("*.py")]
    assert [call for path in sorted(files) for call in unencoded_text_io(path)] == []


def test_a_full_disks_mount_point_is_found_where_path_is_mount_is_missing(monkeypatch, tmp_path):
    """The full-disk line names the disk by its mount point; Python 3.11's Path.is_mount
    raises NotImplementedError on Windows, which would turn that line into a traceback."""
    def windows_is_mount(self):
        raise NotImplementedError("Path.is_mount() is unsupported on this system")
    monkeypatch.setattr(Path, "is_mount", windows_is_mount)
    mount = checkpoint.mount_point(tmp_path / "out" / "ckpt" / "step_0000004.tmp")
    assert os.path.ismount(mount) and tmp_path.resolve().is_relative_to(mount)
