#!/usr/bin/env bash
#SBATCH --job-name=oppo-llama3-8b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-task=8          # one task (one Ray node) per machine, with its 8 GPUs
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=oppo-%j.log
# OPPO on Llama-3-8B PPO across 2 nodes x 8 GPUs under SLURM
# (configs/cluster/multinode-16gpu.yaml: vLLM on 8 GPUs, actor + reference on 4, critic +
# reward model on 4). Starts a Ray head on the first node and a worker on every other node
# (srun), waits until all GPUs have joined, then submits the training job to the head and
# waits for it; the Ray processes end with the allocation.
# Needs: 2 nodes x 8 GPUs of 80 GB, the GPU stack on every node (OPPO_STACK=gpu bash
# scripts/install.sh; add your partition/account/container options to the #SBATCH lines),
# this repository and SAVE_PATH on storage every node can reach.
# Launch, from the repository root (SLURM runs a copy of this file, so it finds the
# repository through the submit directory, or OPPO_ROOT):
#   sbatch examples/scripts/train_oppo_slurm.sh [flags...]
#   flags: any OpenRLHF or --oppo.* flag, overriding the preset
#   bash examples/scripts/train_oppo_slurm.sh --dry-run [flags...]: print the final
#   `ray job submit` command on one line and exit (so does any run outside SLURM); neither
#   calls srun or ray.
# Env vars (defaults): OPPO_ROOT (this file's repository, or the submit directory),
# GPUS_PER_NODE (#SBATCH --gpus-per-task, else 8), RAY_PORT (6379),
# RAY_WAIT_S (300: how long to wait for the workers), SAVE_PATH (./ckpt/<run>: put it on
# shared storage), WANDB_API_KEY (unset: wandb offline), WANDB_PROJECT (openrlhf_oppo),
# WANDB_RUN_NAME (<run>); HEAD_IP (127.0.0.1) names the head in the printed command only.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ ! -f $ROOT/examples/scripts/_common.sh ]]; then ROOT=${SLURM_SUBMIT_DIR:-$PWD}; fi  # sbatch's copy
cd "${OPPO_ROOT:-$ROOT}"
source examples/scripts/_common.sh
oppo_split_args "$@"

RUN=oppo-llama3-8b-16gpu
SAVE_PATH=${SAVE_PATH:-$PWD/ckpt/$RUN}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_PER_TASK:-8}}
RAY_PORT=${RAY_PORT:-6379}
TRAIN=(python3 -m openrlhf_oppo.cli.train_ppo_ray --config configs/cluster/multinode-16gpu.yaml
  --ckpt.output_dir "$SAVE_PATH" --ckpt.path "$SAVE_PATH/ckpt"
  --logger.wandb.project "$WANDB_PROJECT" --logger.wandb.run_name "${WANDB_RUN_NAME:-$RUN}"
  "${EXTRA[@]}")
oppo_runtime_env

if ((DRY_RUN)) || [[ -z ${SLURM_JOB_ID:-} ]]; then
  if ((!DRY_RUN)); then echo "$0: not inside a SLURM allocation (sbatch $0): printing the command only" >&2; fi
  DRY_RUN=1
  RAY_ADDRESS=http://${HEAD_IP:-127.0.0.1}:8265
  oppo_submit "${TRAIN[@]}"
fi

# Ray head on the first node, a worker on each other one (as in Ray's SLURM guide)
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "${NODES[0]}" hostname --ip-address | awk '{print $1}')
srun --nodes=1 --ntasks=1 -w "${NODES[0]}" \
  ray start --head --node-ip-address "$HEAD_IP" --dashboard-host 0.0.0.0 --port "$RAY_PORT" --num-gpus "$GPUS_PER_NODE" --block &
sleep 10
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" \
    ray start --address "$HEAD_IP:$RAY_PORT" --num-gpus "$GPUS_PER_NODE" --block &
done

GPUS=$((${#NODES[@]} * GPUS_PER_NODE))
deadline=$((SECONDS + ${RAY_WAIT_S:-300}))
until ray status --address "$HEAD_IP:$RAY_PORT" 2>/dev/null | grep -Eq "/$GPUS\.0 GPU"; do
  if ((SECONDS > deadline)); then
    echo "$0: Ray did not reach $GPUS GPUs in ${RAY_WAIT_S:-300} s" >&2
    exit 1
  fi
  sleep 5
done

RAY_ADDRESS=http://$HEAD_IP:8265
oppo_submit "${TRAIN[@]}"
