#!/usr/bin/env bash
# OPPO on Llama-3-8B PPO (GAE, critic, reward model) across 2 nodes x 8 GPUs
# (configs/cluster/multinode-16gpu.yaml: vLLM on 8 GPUs, actor + reference on 4, critic +
# reward model on 4).
# Needs: 2 nodes x 8 GPUs of 80 GB, the GPU stack on every node (OPPO_STACK=gpu bash
# scripts/install.sh), this repository and SAVE_PATH on storage every node can reach.
# Start one Ray cluster first:
#   node 0:       ray start --head --node-ip-address $HEAD_IP --dashboard-host 0.0.0.0 --num-gpus 8
#   other nodes:  ray start --address $HEAD_IP:6379 --num-gpus 8
#   (`ray status --address $HEAD_IP:6379` shows 16 GPUs once all have joined)
# Launch (from any machine that reaches the head's dashboard port 8265):
#   HEAD_IP=10.0.0.1 bash examples/scripts/train_oppo_multinode.sh [--dry-run] [flags...]
#   flags: any OpenRLHF or --oppo.* flag, overriding the preset
#   --dry-run: print the `ray job submit` command on one line, run its checks here and exit
# Env vars (defaults): HEAD_IP (127.0.0.1), RAY_ADDRESS (http://$HEAD_IP:8265), SAVE_PATH
# (./ckpt/<run>: put it on shared storage), WANDB_API_KEY (unset: wandb offline),
# WANDB_PROJECT (openrlhf_oppo), WANDB_RUN_NAME (<run>).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RAY_ADDRESS=${RAY_ADDRESS:-http://${HEAD_IP:-127.0.0.1}:8265}
source examples/scripts/_common.sh
oppo_split_args "$@"

RUN=oppo-llama3-8b-16gpu
SAVE_PATH=${SAVE_PATH:-$PWD/ckpt/$RUN}
TRAIN=(python3 -m openrlhf_oppo.cli.train_ppo_ray --config configs/cluster/multinode-16gpu.yaml
  --ckpt.output_dir "$SAVE_PATH" --ckpt.path "$SAVE_PATH/ckpt"
  --logger.wandb.project "$WANDB_PROJECT" --logger.wandb.run_name "${WANDB_RUN_NAME:-$RUN}"
  "${EXTRA[@]}")
oppo_runtime_env
oppo_submit "${TRAIN[@]}"
