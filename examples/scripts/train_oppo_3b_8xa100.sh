#!/usr/bin/env bash
# OPPO on Qwen2.5-3B-Instruct with PPO (GAE, critic) and a 7B reward model on 8 x A100-80G
# (configs/cluster/qwen2.5-3b-8xa100.yaml: vLLM on 4 GPUs, actor + reference on 2, critic +
# reward model on 2, the reward model streamed into while vLLM decodes).
# Needs: 1 node x 8 A100 80 GB, a running Ray cluster (`ray start --head --num-gpus 8`) and
# the GPU stack (OPPO_STACK=gpu bash scripts/install.sh).
# Launch: bash examples/scripts/train_oppo_3b_8xa100.sh [--dry-run] [flags...]
#   flags: any OpenRLHF or --oppo.* flag, overriding the preset
#   --dry-run: print the `ray job submit` command on one line, run its checks here and exit
# Env vars (defaults): RAY_ADDRESS (http://127.0.0.1:8265), SAVE_PATH (./ckpt/<run>),
# WANDB_API_KEY (unset: wandb offline), WANDB_PROJECT (openrlhf_oppo), WANDB_RUN_NAME (<run>).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source examples/scripts/_common.sh
oppo_split_args "$@"

RUN=oppo-qwen2.5-3b-8xa100
SAVE_PATH=${SAVE_PATH:-$PWD/ckpt/$RUN}
TRAIN=(python3 -m openrlhf_oppo.cli.train_ppo_ray --config configs/cluster/qwen2.5-3b-8xa100.yaml
  --ckpt.output_dir "$SAVE_PATH" --ckpt.path "$SAVE_PATH/ckpt"
  --logger.wandb.project "$WANDB_PROJECT" --logger.wandb.run_name "${WANDB_RUN_NAME:-$RUN}"
  "${EXTRA[@]}")
oppo_runtime_env
oppo_submit "${TRAIN[@]}"
