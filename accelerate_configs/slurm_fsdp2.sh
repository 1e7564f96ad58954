#!/bin/bash
# Stack-100M with FSDP2 on N nodes under SLURM. Submit from the repository root, with the
# virtualenv active (sbatch passes the environment on), on a filesystem every node shares
# (the repository, data_dir and out_dir):
#   sbatch --nodes=4 accelerate_configs/slurm_fsdp2.sh [--key=value ...]
# One `accelerate launch` per node, as many ranks as the node has GPUs; the first node of
# the allocation hosts the rendezvous. Flags after the script reach train.py unchanged.
#
# Preemption and the time limit. 300 s before the limit (--signal), or at a preemption,
# SLURM sends SIGTERM to every process of the job step: each rank finishes its step, saves
# a checkpoint and exits 0. torch's elastic agent inside `accelerate launch` waits
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (240 here, inside those 300) for the ranks, then
# the launcher exits non-zero however they ended (accelerate 1.15: 1, 1.16: 143). So the first rank of each node records how the run ended in
# the file STACKLM_OUTCOME names ("stopped STEP" or "finished STEP"): the launch line exits
# 0 when it holds one, and this script requeues the job when the run stopped unfinished.
# The requeued job runs this same command, which resumes from the newest checkpoint.
#SBATCH --job-name=stack100m
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
if [[ ! -f train.py ]]; then
  echo "slurm_fsdp2.sh: no train.py in $PWD; submit from the stacklm repository root" >&2
  exit 2
fi
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:?ask for GPUs with --gpus-per-node}
export WORLD=$((SLURM_NNODES * GPUS_PER_NODE))
# The global batch is the config's on any node count (524,288 tokens for Stack-100M): each
# rank takes the largest micro-batch, at most the configured one (32), that splits it
# evenly. A world size that cannot split it is refused here, in one line.
MICRO=$(python config.py --world_size="$WORLD" --preset=stack100m "$@")
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}
# Node-local files: each node's launch line reads the one its own first rank wrote.
export OUTCOME=${TMPDIR:-/tmp}/stacklm-$SLURM_JOB_ID
echo "slurm_fsdp2.sh: $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, micro-batch $MICRO"
# At a preemption this shell gets SIGTERM too; trapped, it waits for the ranks to save.
trap 'echo "slurm_fsdp2.sh: SIGTERM; waiting for the ranks to save"' TERM
# srun is handed the CPUs itself: from Slurm 22.05 to 23.02 it does not inherit
# --cpus-per-task from sbatch, and a site that binds tasks to cores would run each node's
# launcher and all its ranks on one core.
srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" bash -c '
  trap "echo node $SLURM_NODEID: SIGTERM, the ranks are saving" TERM  # or bash would die now
  export STACKLM_OUTCOME=$OUTCOME.node$SLURM_NODEID
  rm -f "$STACKLM_OUTCOME"
  accelerate launch --config_file accelerate_configs/fsdp2_multinode.yaml \
    --num_machines "$SLURM_NNODES" --num_processes "$WORLD" --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" train.py "$@" \
    || [[ -s $STACKLM_OUTCOME ]]
' bash --preset=stack100m "$@" --micro_batch_size="$MICRO"
read -r outcome step < "$OUTCOME.node0" || outcome=none
if [[ $outcome == stopped ]]; then
  echo "slurm_fsdp2.sh: stopped after step $step, saved; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
