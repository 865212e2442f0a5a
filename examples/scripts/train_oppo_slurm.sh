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
#   `ray start` commands and the `ray job submit` command, each on one line, and exit (so does
#   any run outside SLURM); neither calls srun or ray.
# Each Ray node declares its CPUs and GPUs (`ray start --num-cpus --num-gpus`) and its srun step
# asks SLURM for those CPUs (`--cpus-per-task`): where SLURM confines a step's cores, Ray would
# otherwise count what the step was given (1 CPU by default), and OpenRLHF's placement groups,
# a bundle of 1 GPU and 1 CPU per GPU, would wait forever.
# Env vars (defaults): OPPO_ROOT (this file's repository, or the submit directory),
# GPUS_PER_NODE (#SBATCH --gpus-per-task, else 8), CPUS_PER_NODE (#SBATCH --cpus-per-task, else
# the CPUs SLURM allocated on the node, SLURM_CPUS_ON_NODE: all of them under --exclusive, else
# `nproc`), RAY_PORT (6379),
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
if [[ -n ${CPUS_PER_NODE:-} ]]; then CPUS_FROM=CPUS_PER_NODE
elif [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then CPUS_PER_NODE=$SLURM_CPUS_PER_TASK CPUS_FROM=SLURM_CPUS_PER_TASK
elif [[ -n ${SLURM_CPUS_ON_NODE:-} ]]; then CPUS_PER_NODE=$SLURM_CPUS_ON_NODE CPUS_FROM=SLURM_CPUS_ON_NODE
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
  CPUS_PER_NODE=$(nproc) CPUS_FROM="nproc in the batch step: SLURM set neither SLURM_CPUS_PER_TASK nor SLURM_CPUS_ON_NODE"
else CPUS_PER_NODE='$SLURM_CPUS_ON_NODE' CPUS_FROM="SLURM_CPUS_ON_NODE, known inside the allocation"
fi
if [[ $CPUS_PER_NODE != '$SLURM_CPUS_ON_NODE' ]] && ! [[ $CPUS_PER_NODE =~ ^[0-9]+$ && $GPUS_PER_NODE =~ ^[0-9]+$ ]]; then
  echo "$0: CPUS_PER_NODE ($CPUS_PER_NODE, from $CPUS_FROM) and GPUS_PER_NODE ($GPUS_PER_NODE) must be whole numbers" >&2
  exit 2
fi
if [[ $CPUS_PER_NODE != '$SLURM_CPUS_ON_NODE' ]] && ((CPUS_PER_NODE < GPUS_PER_NODE)); then
  echo "$0: $CPUS_PER_NODE CPUs per node (from $CPUS_FROM) for $GPUS_PER_NODE GPUs: OpenRLHF places a bundle of" \
    "1 GPU and 1 CPU per GPU, so Ray would wait for them forever; give each task at least $GPUS_PER_NODE CPUs" \
    "(#SBATCH --cpus-per-task) or set CPUS_PER_NODE" >&2
  exit 2
fi
RAY_PORT=${RAY_PORT:-6379}
TRAIN=(python3 -m openrlhf_oppo.cli.train_ppo_ray --config configs/cluster/multinode-16gpu.yaml
  --ckpt.output_dir "$SAVE_PATH" --ckpt.path "$SAVE_PATH/ckpt"
  --logger.wandb.project "$WANDB_PROJECT" --logger.wandb.run_name "${WANDB_RUN_NAME:-$RUN}"
  "${EXTRA[@]}")
oppo_runtime_env

# One srun step per node, holding the CPUs its Ray node declares (as in Ray's SLURM guide)
STEP=(srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_NODE")
RESOURCES=(--num-cpus "$CPUS_PER_NODE" --num-gpus "$GPUS_PER_NODE" --block)
ray_starts() {  # HEAD_START and WORKER_START for the head's address
  HEAD_START=(ray start --head --node-ip-address "$HEAD_IP" --dashboard-host 0.0.0.0 --port "$RAY_PORT" "${RESOURCES[@]}")
  WORKER_START=(ray start --address "$HEAD_IP:$RAY_PORT" "${RESOURCES[@]}")
}

if ((DRY_RUN)) || [[ -z ${SLURM_JOB_ID:-} ]]; then
  if ((!DRY_RUN)); then echo "$0: not inside a SLURM allocation (sbatch $0): printing the commands only" >&2; fi
  DRY_RUN=1
  HEAD_IP=${HEAD_IP:-127.0.0.1}
  ray_starts
  echo "# Ray nodes: $CPUS_PER_NODE CPUs (from $CPUS_FROM) and $GPUS_PER_NODE GPUs each"
  printf '%q ' "${STEP[@]}" -w '<first node>' "${HEAD_START[@]}"
  echo
  printf '%q ' "${STEP[@]}" -w '<each other node>' "${WORKER_START[@]}"
  echo
  RAY_ADDRESS=http://$HEAD_IP:8265
  oppo_submit "${TRAIN[@]}"
fi

# Ray head on the first node, a worker on each other one
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "${NODES[0]}" hostname --ip-address | awk '{print $1}')
ray_starts
echo "$0: Ray nodes: $CPUS_PER_NODE CPUs (from $CPUS_FROM) and $GPUS_PER_NODE GPUs each" >&2
"${STEP[@]}" -w "${NODES[0]}" "${HEAD_START[@]}" &
sleep 10
for node in "${NODES[@]:1}"; do
  "${STEP[@]}" -w "$node" "${WORKER_START[@]}" &
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
