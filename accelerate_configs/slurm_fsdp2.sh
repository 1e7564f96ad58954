#!/bin/bash
# Stack-100M with FSDP2 on N nodes x 8 GPUs under SLURM:   sbatch --nodes=4 accelerate_configs/slurm_fsdp2.sh
# One `accelerate launch` per node; the first node of the allocation is the rendezvous host.
# The checkpoint in out_dir is found again after a requeue (resume=auto), and SIGTERM from
# a preemption makes every rank finish its step, save and exit 0.
#SBATCH --job-name=stack100m
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
# The global batch stays 524,288 tokens: 32 sequences per GPU fit 8 GPUs, so each node more
# halves the micro-batch (1, 2, 4, 8 nodes: 32, 16, 8, 4); a flag after the script wins.
MICRO=$(( 32 / SLURM_NNODES ))
srun --kill-on-bad-exit=1 bash -c "accelerate launch \
  --config_file accelerate_configs/fsdp2_multinode.yaml \
  --num_machines $SLURM_NNODES --num_processes $((SLURM_NNODES * 8)) \
  --machine_rank \$SLURM_NODEID --main_process_ip $MASTER_ADDR --main_process_port $MASTER_PORT \
  train.py --preset=stack100m --micro_batch_size=$MICRO $*"
