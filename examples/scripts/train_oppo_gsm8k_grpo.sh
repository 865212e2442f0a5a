#!/usr/bin/env bash
# OPPO on GSM8K with GRPO (8 samples per prompt) and the rule-based reward
# examples/scripts/reward_gsm8k.py, Qwen2.5-1.5B-Instruct on one 8-GPU node
# (configs/cluster/gsm8k-grpo.yaml: vLLM on 4 GPUs, actor + reference on 4).
# Needs: 1 node x 8 GPUs (40 GB or more), a running Ray cluster (`ray start --head
# --num-gpus 8`), the GPU stack (OPPO_STACK=gpu bash scripts/install.sh), hub access to
# openai/gsm8k (or a local copy: see the preset).
# Launch: bash examples/scripts/train_oppo_gsm8k_grpo.sh [--dry-run] [flags...]
#   flags: any OpenRLHF or --oppo.* flag, overriding the preset
#   --dry-run: print the `ray job submit` command on one line, run its checks here and exit
# Env vars (defaults): RAY_ADDRESS (http://127.0.0.1:8265), SAVE_PATH (./ckpt/<run>),
# WANDB_API_KEY (unset: wandb offline), WANDB_PROJECT (openrlhf_oppo), WANDB_RUN_NAME (<run>).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source examples/scripts/_common.sh
oppo_split_args "$@"

RUN=oppo-gsm8k-grpo
SAVE_PATH=${SAVE_PATH:-$PWD/ckpt/$RUN}
TRAIN=(python3 -m openrlhf_oppo.cli.train_ppo_ray --config configs/cluster/gsm8k-grpo.yaml
  --ckpt.output_dir "$SAVE_PATH" --ckpt.path "$SAVE_PATH/ckpt"
  --logger.wandb.project "$WANDB_PROJECT" --logger.wandb.run_name "${WANDB_RUN_NAME:-$RUN}"
  "${EXTRA[@]}")
oppo_runtime_env
oppo_submit "${TRAIN[@]}"
