"""The cluster path rehearsed on one CPU machine: accelerate_configs/slurm_fsdp2.sh itself on
two "nodes" (stub `srun` and `scontrol` on PATH), a preemption delivered as SLURM delivers
it and to the launcher alone, the micro-batch for any node count, and what train.py does
with each key of an accelerate launch config (read through accelerate's own launcher)."""

import dataclasses
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

import config
import train
from conftest import LOSS_RTOL, WEIGHT_TOL, micro_config
from test_resume import MakesDir
from test_train import (REPO, assert_weights, checkpoint_weights, cli_args, free_port,
                        launch_command, train_records, watched_train_py)
from plumbing import checkpoint, launch, overrides

JOB_ID = "4242"

# srun on one machine: the step's command once per "node", each told its SLURM_NODEID;
# node 0 first, the others once node 0's launcher holds the rendezvous port (two launchers
# on one address would both try to host it). Exits non-zero if any node did. It keeps its
# arguments, NUL-separated, in srun.args; with STUB_DRY set it runs nothing.
SRUN = """#!/bin/bash
printf '%s\\0' "$@" > "$TMPDIR/srun.args"
[[ -n ${STUB_DRY:-} ]] && exit 0
while [[ $1 == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node "$@" &
  pids+=($!)
  until ((node > 0)) || (exec 3<>"/dev/tcp/127.0.0.1/$MASTER_PORT") 2>/dev/null; do
    kill -0 "${pids[0]}" 2>/dev/null || break
    sleep 0.1
  done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

# scontrol: the allocation's first host, and a log of requeues.
SCONTROL = """#!/bin/bash
case $1 in
  show) echo 127.0.0.1 ;;
  requeue) echo "requeue $2" >> "$STUB_LOG" ;;
esac
"""


def slurm_env(tmp_path: Path, nodes: int) -> dict:
    """The environment sbatch gives the script on `nodes` nodes of 1 "GPU" each, with the
    stubs first on PATH; they log to tmp_path/stubs.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_NNODES": str(nodes), "SLURM_GPUS_ON_NODE": "1", "SLURM_SUBMIT_DIR": str(REPO),
            "SLURM_CPUS_PER_TASK": "64",  # what sbatch sets from the script's --cpus-per-task
            "MASTER_PORT": str(free_port()), "TMPDIR": str(tmp_path),
            "STUB_LOG": str(tmp_path / "stubs.log")}


def processes_of(marker: str) -> list[int]:
    """Every live process whose command line holds `marker` (a test's unique out_dir)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:  # it exited while we looked
            continue
    return [pid for pid in found if pid != os.getpid()]


def all_below(pid: int) -> list[int]:
    """Every descendant of pid, however deep, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):  # it exited while we looked
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def wait_for_steps(cfg, n: int, proc: subprocess.Popen):
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    deadline = time.time() + 180
    while not metrics.exists() or metrics.read_text().count('"kind": "train"') < n:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)


def preemptible(data_dir: str, out_dir: str):
    """Long enough (60 steps, seconds) that a signal sent after step 3 lands mid-run; one
    checkpoint, at the end."""
    return micro_config(data_dir, out_dir, total_steps=60, stop_at_step=60, eval_every=1000,
                        ckpt_every=1000, warmup_steps=10)


@pytest.fixture(scope="module")
def straight(small_data_dir, tmp_path_factory) -> dict:
    """The preemptible run, never interrupted, in this one process: its final weights and
    its logged losses."""
    cfg = preemptible(small_data_dir, str(tmp_path_factory.mktemp("straight")))
    train.main(cfg)
    return {"weights": checkpoint_weights(cfg, 60),
            "losses": {r["step"]: r["loss"] for r in train_records(cfg)}}


def assert_resumed_exactly(cfg, straight: dict, stopped_at: int):
    """The interrupted run's final weights, and every loss it logged after the stop, equal
    the uninterrupted run's bit for bit (DDP over gloo on 2 ranks sums each gradient as one
    process accumulating 2 micro-batches does: measured equal, not just close)."""
    assert_weights(checkpoint_weights(cfg, 60), straight["weights"])
    after = {r["step"]: r["loss"] for r in train_records(cfg) if r["step"] > stopped_at}
    assert after == {step: straight["losses"][step] for step in after} and 60 in after


def outcome(path: Path) -> tuple[str, int]:
    word, step = path.read_text().split()
    return word, int(step)


# --- slurm_fsdp2.sh --------------------------------------------------------------------

@pytest.mark.distributed
def test_slurm_script_on_two_nodes_saves_on_sigterm_requeues_and_continues_its_branch(
        small_data_dir, tmp_path, straight):
    """The script itself, 2 nodes × 1 rank, through accelerate launch with --num_machines 2
    and the multi-node config's c10d rendezvous: FSDP2, sharded over gloo. The job is an
    anneal branched from a stable run's step-2 checkpoint (--resume=PATH). SIGTERM goes to
    every process of the job step (the node shells, both launchers, both ranks), as SLURM's
    --signal sends it: the step in flight is saved, the script exits 0 and requeues the job,
    no process is left. The requeued job, the same command, continues the branch from its
    own checkpoint (not the branch point again) and ends within README's FSDP2 tolerance of
    one process never stopped."""
    stable = dataclasses.replace(preemptible(small_data_dir, str(tmp_path / "stable")),
                                 stop_at_step=2)
    train.main(stable)
    cfg = dataclasses.replace(preemptible(small_data_dir, str(tmp_path / "run")),
                              resume=str(checkpoint.step_path(stable.out_dir, 2)))
    env = slurm_env(tmp_path, nodes=2)
    command = ["bash", "accelerate_configs/slurm_fsdp2.sh", *cli_args(cfg)]
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    wait_for_steps(cfg, 3, job)
    srun = next(p for p in all_below(job.pid) if b"srun" in Path(f"/proc/{p}/cmdline").read_bytes())
    for pid in all_below(srun):
        os.kill(pid, signal.SIGTERM)
    output, _ = job.communicate(timeout=180)
    assert job.returncode == 0, output[-4000:]
    assert "micro-batch 4" in output  # 8 sequences per step over 2 ranks
    # the config's mixed_precision (no, as every test's) wins over the yaml's bf16, aloud
    assert "the launch config's mixed_precision=bf16 is ignored: this run uses no" in output
    word, stopped_at = outcome(tmp_path / f"stacklm-{JOB_ID}.node0")
    assert word == "stopped" and 3 <= stopped_at < 60
    assert outcome(tmp_path / f"stacklm-{JOB_ID}.node1") == ("stopped", stopped_at)
    assert checkpoint.find(cfg.out_dir, "latest") == checkpoint.step_path(cfg.out_dir, stopped_at)
    assert (tmp_path / "stubs.log").read_text().splitlines()[-1] == f"requeue {JOB_ID}"
    assert processes_of(cfg.out_dir) == []

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"resumed from {checkpoint.step_path(cfg.out_dir, stopped_at)} at step " \
           f"{stopped_at} (its own; --resume={cfg.resume} is where this run began" in rerun.stdout
    assert outcome(tmp_path / f"stacklm-{JOB_ID}.node0") == ("finished", 60)
    assert (tmp_path / "stubs.log").read_text().count("requeue") == 1  # finished: no requeue
    assert not list((Path(cfg.out_dir) / "ckpt").glob("*.replaced"))
    assert_weights(checkpoint_weights(cfg, 60), straight["weights"], atol=WEIGHT_TOL)
    after = {r["step"]: r["loss"] for r in train_records(cfg) if r["step"] > stopped_at}
    assert after == pytest.approx({s: straight["losses"][s] for s in after}, rel=LOSS_RTOL)


# accelerate on one "node", for the tests of the script's own logic: it keeps its arguments
# (NUL-separated) and the environment the script gave it, records the ending STUB_ENDING
# names where STACKLM_OUTCOME says ("crashed": none), and exits non-zero, as the launcher
# does after a SIGTERM however the ranks ended. No training: each test takes seconds.
ACCELERATE = """#!/bin/bash
printf '%s\\0' "$@" > "$TMPDIR/accelerate.args$SLURM_NODEID"
echo "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT $STACKLM_OUTCOME" > "$TMPDIR/accelerate.env$SLURM_NODEID"
[[ $STUB_ENDING == crashed ]] || echo "$STUB_ENDING 7" > "$STACKLM_OUTCOME"
exit 1
"""


def stub_nodes(tmp_path: Path, nodes: int, ending: str, gpus: int = 1) -> dict:
    """slurm_env, with the stub accelerate on PATH too, ending its run as `ending` says."""
    env = slurm_env(tmp_path, nodes)
    (tmp_path / "bin" / "accelerate").write_text(ACCELERATE)
    (tmp_path / "bin" / "accelerate").chmod(0o755)
    return env | {"STUB_ENDING": ending, "SLURM_GPUS_ON_NODE": str(gpus)}


def requeues(tmp_path: Path) -> list[str]:
    log_file = tmp_path / "stubs.log"
    return [line for line in log_file.read_text().splitlines()
            if line.startswith("requeue")] if log_file.exists() else []


@pytest.mark.parametrize("ending, exit_status, requeued", [
    ("crashed", 1, False), ("stopped", 0, True), ("finished", 0, False)])
def test_slurm_script_requeues_only_a_stop_this_attempt_recorded(tmp_path, ending, exit_status,
                                                                 requeued):
    """An earlier attempt of the same job (same job id, same node-local TMPDIR) left
    "stopped 3" on both nodes. This attempt's launcher exits 1 each time, as the elastic agent
    does: after a crash that recorded nothing the job fails and is not requeued (the old
    record must not speak for it); after a recorded stop the script exits 0 and requeues;
    after a recorded finish it exits 0 and does not."""
    env = stub_nodes(tmp_path, nodes=2, ending=ending)
    records = [tmp_path / f"stacklm-{JOB_ID}.node{node}" for node in (0, 1)]
    for record in records:
        record.write_text("stopped 3\n")
    done = subprocess.run(["bash", "accelerate_configs/slurm_fsdp2.sh", "--preset=tiny"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == exit_status, done.stdout + done.stderr
    assert requeues(tmp_path) == ([f"requeue {JOB_ID}"] if requeued else [])
    if ending == "crashed":
        assert not any(record.exists() for record in records)  # cleared before the launch
    else:
        assert [outcome(record) for record in records] == [(ending, 7)] * 2


def test_slurm_script_launches_each_node_at_the_first_nodes_rendezvous(tmp_path):
    """2 nodes × 4 GPUs: each node's one `accelerate launch` starts 4 of the 8 ranks as
    machine k of 2, meeting at the allocation's first host, with the micro-batch config.py
    derived for 8 ranks (Stack-100M: 32) after the caller's flags. The elastic agent waits
    240 s for the ranks, inside the 300 s --signal gives before the limit; each node's first
    rank records in a file of its own node."""
    env = stub_nodes(tmp_path, nodes=2, ending="finished", gpus=4)
    done = subprocess.run(["bash", "accelerate_configs/slurm_fsdp2.sh", "--seed=7"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 nodes x 4 GPUs, micro-batch 32" in done.stdout
    header = (REPO / "accelerate_configs" / "slurm_fsdp2.sh").read_text()
    [lead] = re.findall(r"^#SBATCH --signal=TERM@(\d+)$", header, re.M)
    for node in (0, 1):
        args = (tmp_path / f"accelerate.args{node}").read_text().split("\0")[:-1]
        assert args == ["launch", "--config_file", "accelerate_configs/fsdp2_multinode.yaml",
                        "--num_machines", "2", "--num_processes", "8", "--machine_rank",
                        str(node), "--main_process_ip", "127.0.0.1", "--main_process_port",
                        env["MASTER_PORT"], "train.py", "--preset=stack100m", "--seed=7",
                        "--micro_batch_size=32"]
        timeout, record = (tmp_path / f"accelerate.env{node}").read_text().split()
        assert int(timeout) == 240 < int(lead) == 300
        assert record == str(tmp_path / f"stacklm-{JOB_ID}.node{node}")


def test_slurm_script_refuses_to_start_outside_the_repository(tmp_path):
    env = slurm_env(tmp_path, nodes=1) | {"SLURM_SUBMIT_DIR": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO / "accelerate_configs" / "slurm_fsdp2.sh")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == (f"slurm_fsdp2.sh: no train.py in {tmp_path}; submit from the "
                           f"stacklm repository root\n")
    assert not (tmp_path / "srun.args").exists()


@pytest.mark.parametrize("nodes", [3, 64])
def test_slurm_script_refuses_a_world_that_cannot_split_the_global_batch(tmp_path, nodes):
    """Stack-100M's 256 sequences per step split over no multiple of 3 ranks, and over no
    more than 256 (64 nodes × 8): one line, exit 2, before any node starts."""
    env = slurm_env(tmp_path, nodes) | {"SLURM_GPUS_ON_NODE": "8"}
    done = subprocess.run(["bash", "accelerate_configs/slurm_fsdp2.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().startswith(
        f"error: global_batch_tokens=524,288 is not divisible by micro_batch_size*seq_len*"
        f"world_size=32*2048*{nodes * 8}=")
    assert done.stderr.strip().endswith(" or another number of ranks")
    assert not (tmp_path / "srun.args").exists()  # no node started


def test_micro_batch_fits_any_world_size():
    """Stack-100M's 256 sequences per step, at most 32 per forward: 8 GPUs take 32 each in
    1 micro-batch; 2 take 128 each, as 4 of 32; 64 take 4; 24 or 512 cannot split 256."""
    cfg = config.stack100m()
    expected = {1: 32, 2: 32, 8: 32, 16: 16, 32: 8, 64: 4, 256: 1, 24: None, 512: None}
    assert {world: cfg.fitting_micro_batch(world) for world in expected} == expected
    assert overrides.apply_overrides(cfg, {"micro_batch_size": 16}).fitting_micro_batch(2) == 16


def test_slurm_script_passes_arguments_whole(tmp_path):
    """"$@", not $*: a flag whose value holds spaces reaches each node's launch line as one
    argument, after the script's own, and before the micro-batch it derived (--preset tiny:
    16 sequences per step over 8 ranks, 2 each). srun is given the job's CPUs per task
    itself (Slurm 22.05 to 23.02 would give each node's ranks one core)."""
    env = slurm_env(tmp_path, nodes=1) | {"SLURM_GPUS_ON_NODE": "8", "STUB_DRY": "1"}
    done = subprocess.run(["bash", "accelerate_configs/slurm_fsdp2.sh",
                           "--sample_prompt=def main(argv):", "--preset", "tiny"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    args = (tmp_path / "srun.args").read_text().split("\0")[:-1]
    node_script = next(a for a in args if "accelerate launch" in a)
    assert "--cpus-per-task=64" in args[:args.index(node_script)]
    assert args[args.index(node_script) + 1:] == [
        "bash", "--preset=stack100m", "--sample_prompt=def main(argv):", "--preset", "tiny",
        "--micro_batch_size=2"]


# --- a SIGTERM to the launcher alone -----------------------------------------------------

@pytest.mark.distributed
def test_sigterm_to_the_launcher_alone_saves_and_records_the_stop(small_data_dir, tmp_path,
                                                                  straight):
    """accelerate launch, 2 ranks; SIGTERM to the launcher only (torch's workers start
    sessions of their own, so only the launcher gets a terminal's or a kill's signal). Its
    elastic agent passes it on to each rank and waits for them; each saves and exits 0, and
    the outcome file says the run stopped cleanly. The launcher's own exit status is not
    asserted: it says nothing about the ranks, and it differs between the accelerate
    versions requirements.txt admits (1.15's exits 1, 1.16's 143). Checkpoints are written
    in the background every 2 steps (ckpt_async), so one is often in flight when the signal
    comes: it is completed before the step in flight is saved, and none is left .tmp."""
    cfg = dataclasses.replace(preemptible(small_data_dir, str(tmp_path / "run")),
                              ckpt_async=True, ckpt_every=2)
    launcher = start_two_ranks(cfg, tmp_path / "out")
    wait_for_steps(cfg, 3, launcher)
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert output.count("stop requested after step") == 1, output[-3000:]  # rank 0 prints it
    word, stopped_at = outcome(tmp_path / "out")
    assert word == "stopped" and 3 <= stopped_at < 60, output[-3000:]
    assert checkpoint.find(cfg.out_dir, "latest") == checkpoint.step_path(cfg.out_dir, stopped_at)
    assert not list(checkpoint.ckpt_root(cfg.out_dir).glob("*.tmp"))
    assert processes_of(cfg.out_dir) == []

    train.main(cfg)  # the rerun, in one process: the 2-rank checkpoint reshards onto 1
    assert outcome(tmp_path / "out") == ("stopped", stopped_at)  # this process has no file
    assert_resumed_exactly(cfg, straight, stopped_at)


def start_two_ranks(cfg, outcome_file: Path) -> subprocess.Popen:
    """train.py on 2 ranks under accelerate launch, recording its outcome in outcome_file."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", launch.OUTCOME_FILE: str(outcome_file)}
    return subprocess.Popen(launch_command(cfg, processes=2), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)


@pytest.mark.distributed
def test_a_sigterm_that_reaches_one_rank_stops_every_rank_at_the_same_step(small_data_dir,
                                                                          tmp_path):
    """train_step's promise: every rank must agree to stop, so the flag is summed over the
    ranks. SIGTERM to rank 1 alone (the launcher and rank 0 never see it): both ranks stop
    after the same step and save it together, and the launcher, never signalled, exits 0."""
    cfg = preemptible(small_data_dir, str(tmp_path / "run"))
    launcher = start_two_ranks(cfg, tmp_path / "out")
    wait_for_steps(cfg, 3, launcher)
    [rank1] = [pid for pid in processes_of(cfg.out_dir) if rank_of(pid) == 1]
    os.kill(rank1, signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, output[-3000:]
    word, stopped_at = outcome(tmp_path / "out")
    assert word == "stopped" and 3 <= stopped_at < 60
    assert checkpoint.find(cfg.out_dir, "latest") == checkpoint.step_path(cfg.out_dir, stopped_at)
    assert f"stop requested after step {stopped_at}" in output


@pytest.mark.distributed
def test_a_file_refused_on_one_rank_only_stops_every_rank_with_its_reason(small_data_dir,
                                                                         tmp_path):
    """Rank 1's RNG file of the newest checkpoint is a pickle that would run code (its
    __reduce__ is os.mkdir); rank 0's reads fine. Every rank refuses it with rank 1's reason,
    printed once, on one line, by rank 0; nothing runs; a rank exits 2 having left its
    process group (this error path once ended in SIGABRT at exit, gloo's threads torn down
    with the interpreter), and no rank's traceback is printed, only the launcher's report."""
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    rng1, marker = checkpoint.step_path(cfg.out_dir, 4) / "rng_rank1.pt", tmp_path / "pwned"
    torch.save(MakesDir(marker), rng1)
    command = launch_command(dataclasses.replace(cfg, stop_at_step=6), processes=2)
    command[command.index("train.py")] = str(watched_train_py(tmp_path))
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {rng1}: holds a reference to posix.mkdir, which a checkpoint "
                      f"this trainer wrote never does; refusing to read it (unpickling it could "
                      f"run code). Delete this checkpoint folder or replace it with one this "
                      f"trainer wrote (rank 1)"], done.stderr[-3000:]
    # The first rank out exits 2; the launcher then ends the other (SIGTERM) and reports.
    assert "(exitcode: 2)" in done.stderr and "terminate called" not in done.stderr
    assert "Traceback" not in done.stderr.split("ChildFailedError")[0].split("failed (exitcode")[0]
    left = re.findall(r"process group at exit: (\w+)", done.stdout)
    assert left and set(left) == {"False"}, done.stdout[-3000:]
    assert not marker.exists()


# train.py's command, where rank 1's disk fills while step 4's checkpoint is written: DCP's
# writer raises there what a full disk raises.
FULL_DISK_ON_RANK_1 = """\
import errno, os, sys
from torch.distributed.checkpoint.filesystem import FileSystemWriter
import train
write = FileSystemWriter.write_data
def full(self, plan, planner):
    if os.environ["RANK"] == "1" and "step_0000004" in str(self.path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write(self, plan, planner)
FileSystemWriter.write_data = full
train.cli(sys.argv[1:])
"""


@pytest.mark.distributed
def test_a_disk_full_on_one_rank_only_stops_every_rank_in_one_line(small_data_dir, tmp_path):
    """Rank 1's disk fills while step 4's checkpoint is written (blocking). DCP's save is
    collective, so every rank stops; rank 0 prints one line, naming rank 1's error, the step,
    the disk and the checkpoint the same command resumes from, and a rank exits 2 with no
    traceback. Step 2's stays the newest complete checkpoint."""
    from test_checkpoint import disk_of
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=2)
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_ON_RANK_1)
    command = launch_command(cfg, processes=2)
    command[command.index("train.py")] = str(script)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    root = checkpoint.ckpt_root(cfg.out_dir)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the checkpoint of step 4 failed while it was written: rank 1: "
                      f"OSError: [Errno 28] No space left on device; {root}/step_0000004.tmp "
                      f"is incomplete, and the newest complete checkpoint is still "
                      f"{root}/step_0000002; once there is room on the disk mounted at "
                      f"{disk_of(root)}, run the same command: it resumes from there"], \
        done.stderr[-3000:]
    assert "(exitcode: 2)" in done.stderr
    assert "Traceback" not in done.stderr.split("ChildFailedError")[0].split("failed (exitcode")[0]
    assert checkpoint.complete_checkpoints(cfg.out_dir) == [root / "step_0000002"]


@pytest.mark.distributed
def test_a_file_damaged_for_one_rank_only_is_skipped_by_every_rank(small_data_dir, tmp_path):
    """Rank 1's RNG file of the newest checkpoint is cut short; rank 0's reads fine. The
    ranks vote, so both set it aside and resume from the one before (a rank resuming alone
    would leave the other in another checkpoint's collective reads), and the 2-rank run ends
    where one process never interrupted does."""
    cfg = micro_config(small_data_dir, str(tmp_path / "run"), ckpt_every=2, stop_at_step=4)
    train.main(cfg)
    rng = (checkpoint.step_path(cfg.out_dir, 4) / "rng_rank0.pt").read_bytes()
    (checkpoint.step_path(cfg.out_dir, 4) / "rng_rank1.pt").write_bytes(rng[: len(rng) // 2])
    command = launch_command(dataclasses.replace(cfg, stop_at_step=6), processes=2)
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rng1 = checkpoint.step_path(cfg.out_dir, 4) / "rng_rank1.pt"
    assert f"skipping damaged checkpoint: {rng1}: " in done.stdout  # rank 1's own reason
    assert "(rank 1); kept as" in done.stdout
    assert f"resumed from {checkpoint.step_path(cfg.out_dir, 2)} at step 2" in done.stdout
    straight = micro_config(small_data_dir, str(tmp_path / "straight"), ckpt_every=2,
                            stop_at_step=6)
    train.main(straight)
    assert_weights(checkpoint_weights(cfg, 6), checkpoint_weights(straight, 6))


def test_a_sigterm_after_training_still_exits_zero(small_data_dir, tmp_path, monkeypatch):
    """A SIGTERM during the end-of-run sample (or the last evaluation) is answered like any
    other: the run ends normally and its outcome is "finished". (Here a handler of the
    test's own stands where the default one, which kills the process with -15, would be:
    it sees any SIGTERM the run's own handler does not take.)"""
    complete, escaped = train.complete, []

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return complete(*args, **kwargs)
    monkeypatch.setattr(train, "complete", interrupted)
    monkeypatch.setenv(launch.OUTCOME_FILE, str(tmp_path / "out"))
    previous = signal.signal(signal.SIGTERM, lambda *_: escaped.append(True))
    try:
        metrics = train.main(micro_config(small_data_dir, str(tmp_path / "run"), stop_at_step=4))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert escaped == [] and metrics["sample"]
    assert outcome(tmp_path / "out") == ("finished", 4)


def test_a_sigterm_during_setup_stops_the_run_after_its_first_step(small_data_dir, tmp_path,
                                                                   monkeypatch):
    """README: a signal during setup (hashing shards, building the model: minutes at scale)
    stops the run after its first step, saved. A handler of the test's own catches any
    SIGTERM the run's handler does not take."""
    from plumbing import log
    revision, escaped = log.code_revision, []

    def interrupted():
        os.kill(os.getpid(), signal.SIGTERM)
        return revision()
    monkeypatch.setattr(log, "code_revision", interrupted)  # called inside setup
    monkeypatch.setenv(launch.OUTCOME_FILE, str(tmp_path / "out"))
    previous = signal.signal(signal.SIGTERM, lambda *_: escaped.append(True))
    try:
        train.main(micro_config(small_data_dir, str(tmp_path / "run")))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert escaped == []
    assert outcome(tmp_path / "out") == ("stopped", 1)
    assert checkpoint.find(str(tmp_path / "run"), "latest").name == "step_0000001"


# --- the launch config -----------------------------------------------------------------

def launched_env(yaml_text: str, tmp_path: Path) -> dict:
    """The environment `accelerate launch --config_file` gives its workers for this yaml,
    made by accelerate's own launcher code."""
    yaml = tmp_path / "launch.yaml"
    yaml.write_text(yaml_text)
    args = launch_command_parser().parse_args(["--config_file", str(yaml), "train.py"])
    return prepare_multi_gpu_env(_validate_launch_command(args)[0])


@pytest.mark.parametrize("yaml", ["fsdp2.yaml", "fsdp2_multinode.yaml", "ddp.yaml"])
def test_the_shipped_launch_configs_pass_the_check(yaml, tmp_path):
    text = (REPO / "accelerate_configs" / yaml).read_text()
    env = launched_env(text, tmp_path)
    launch.check_launch(env)  # refuses nothing
    assert launch.precision_warnings(env, "bf16") == []
    assert launch.reshard_after_forward(env)
    assert launch.precision_warnings(env, "no") == [
        "warning: the launch config's mixed_precision=bf16 is ignored: this run uses no, from "
        "its config (--mixed_precision chooses)"]


FSDP_YAML = (REPO / "accelerate_configs" / "fsdp2.yaml").read_text()


@pytest.mark.parametrize("key, value", [
    ("fsdp_offload_params", "true"), ("fsdp_activation_checkpointing", "true"),
    ("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"), ("fsdp_state_dict_type",
                                                          "FULL_STATE_DICT"),
    ("fsdp_cpu_ram_efficient_loading", "false"), ("fsdp_forward_prefetch", "true"),
    ("fsdp_version", "1"), ("fsdp_reshard_after_forward", "shard_grad_op")])
def test_a_launch_config_key_train_py_would_not_honour_is_refused(key, value, tmp_path):
    env = launched_env(f"{FSDP_YAML}  {key}: {value}\n", tmp_path)
    with pytest.raises(ValueError, match=f"^launch config: {key}={value} "):
        launch.check_launch(env)


def test_every_fsdp_variable_accelerate_passes_on_is_honoured_or_checked(tmp_path):
    """What accelerate's launcher exports for fsdp2.yaml (every key it knows that has a
    default): each variable is one train.py honours or one it refuses off its default."""
    exported = {name for name in launched_env(FSDP_YAML, tmp_path) if name.startswith("FSDP_")}
    assert exported - set(launch.REFUSED_FSDP_KEYS) == {"FSDP_VERSION",
                                                        "FSDP_RESHARD_AFTER_FORWARD"}


@pytest.mark.parametrize("variable", sorted(launch.REFUSED_FSDP_KEYS))
def test_every_fsdp_key_train_py_does_not_honour_is_refused_off_its_default(variable):
    """Each variable of REFUSED_FSDP_KEYS, set to anything but accelerate's default, is
    refused naming the yaml key; at its default (or absent) it passes."""
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    default = launch.REFUSED_FSDP_KEYS[variable][0]
    launch.check_launch(env | ({} if default is None else {variable: default}))
    with pytest.raises(ValueError, match=f"^launch config: {variable.lower()}=odd is not "
                                         f"honoured: .*; remove it from the yaml"):
        launch.check_launch(env | {variable: "odd"})


def test_fsdp_reshard_after_forward_false_reaches_shard_model(tmp_path):
    """The one FSDP key with an effect: test_fsdp.py shows shard_model keeping the weights
    gathered after the forward when it is false."""
    env = launched_env(FSDP_YAML.replace("reshard_after_forward: true",
                                         "reshard_after_forward: false"), tmp_path)
    launch.check_launch(env)  # refuses nothing
    assert not launch.reshard_after_forward(env)


def test_dynamo_in_the_launch_config_is_refused(tmp_path):
    env = launched_env(FSDP_YAML + "dynamo_config:\n  dynamo_backend: INDUCTOR\n", tmp_path)
    with pytest.raises(ValueError, match="would compile the model a second time"):
        launch.check_launch(env)


@pytest.mark.parametrize("key, value", [("fsdp_version", "1"), ("fsdp_offload_params", "true"),
                                        ("fsdp_reshard_after_forward", "maybe")])
def test_train_refuses_a_launch_key_before_accelerate_reads_it(key, value, small_data_dir,
                                                               tmp_path, monkeypatch, capsys):
    """train.py's own line, from the environment accelerate launch exports for the yaml, and
    before data, model or out_dir: made first, the Accelerator ended fsdp_version 1 in
    accelerate's traceback (FSDP1 on a CPU) and `maybe` in 'invalid truth value maybe',
    naming neither key nor file."""
    env = launched_env(f"{FSDP_YAML}  {key}: {value}\n", tmp_path)
    for name in [n for n in env if n.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.setenv(name, env[name])
    cfg = micro_config(small_data_dir, str(tmp_path / "run"))
    with pytest.raises(SystemExit) as exit_:
        train.cli(cli_args(cfg))
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: launch config: {key}={value} "), line
    assert not (tmp_path / "run").exists()
