"""A learnable task with a learned reward model, built in code and cached on disk.

The task: reverse a list of words ("reverse: red cat blue dog =>" -> " dog blue cat red").
List lengths are heavy-tailed (RL prompts: 60 % 1-6 words, 30 % 7-14, 10 % 15-40), and a
response is one token per word plus EOS, so response lengths have a long tail, as in real
RLHF. The training data (SFT records, the reward model's hand-made pairs) holds mostly short
lists (85 % 1-6 words), so the SFT policy reverses short lists and fails on most longer ones:
RL has something to gain, on the long prompts. The reward model also trains on the SFT
policy's own wrong samples (on prompts with the RL prompts' lengths), the mistakes PPO starts
from.

    prompt   "reverse: red cat blue dog =>"
    answer   "dog blue cat red"            (the `label` in prompts.jsonl)
    response " dog blue cat red<|eos|>"    (what SFT teaches; `exact_match` checks it)

Built by the lab (`python -m oppo_lab build-learn`, in a checkout of the repository), with
OpenRLHF's own trainers run as subprocesses through the CPU compat layer; the `learn-longtail`
build ships in the package, and `build` installs it (`openrlhf-oppo prepare --variant
learn-longtail`, or on first use by a run config with `task: {variant: learn-longtail}`):

    tokenizer/        byte-level BPE (every word of the vocabulary is one token)
    init_actor/       randomly initialised Qwen2ForCausalLM, SFT's starting point
    actor/            the SFT policy (`python -m openrlhf.cli.train_sft`): actor and reference
    reward/           Bradley-Terry reward model (`python -m openrlhf.cli.train_rm`), initialised
                      from the SFT policy; OpenRLHF's layout (`--reward.model_name_or_path`), and
                      the critic's initialisation, as OpenRLHF does by default
    data/sft.jsonl          {"input", "output"}: prompt, response (with EOS)
    data/rm_mistakes.jsonl  {"prompt", "chosen", "rejected", "kind"}: gold vs one plausible mistake
    data/rm_policy.jsonl    same, gold vs a wrong sample of the SFT policy (kind "policy")
    data/rm_train.jsonl     the reward model's training pairs: both of the above
    data/rm_heldout.jsonl   same, another seed, the RL prompts' length law (RM held-out accuracy)
    prompts.jsonl     {"input", "label"}: RL prompts with the ground-truth answer
    summary.json      what `build` measured (losses, accuracies, lengths, stage times)
    BUILD_OK          written last; the asset version and the spec

Splits: SFT, RM-train, RM-held-out and RL prompts are each drawn from their own seed.
Lists of 1-2 words (930 possible) inevitably repeat across splits; longer ones
practically never do. Measurements on "unseen" prompts leave out those in the SFT set.

Trainer precision (`LearnSpec.train_dtype`): OpenRLHF 0.11.2's trainers accept
`--ds.param_dtype` bf16 or fp16 only. On a CPU without AVX512-BF16 / AMX (the 2-core
development machine has neither) bf16 matmuls are emulated: a forward + backward of the
actor took 7-11x as long as in fp32, and a whole OpenRLHF SFT step 2-3x. By default the
trainers therefore run with fp32 parameters (`oppo_lab.learn.trainers.fp32_trainer_main`: the
same trainers, with train_rm's batches also grouped by length); `train_dtype="bf16"` runs
them exactly as OpenRLHF ships them. The saved models are fp32; PPO loads them in bf16, and
`build` measures them in bf16 as PPO runs them.

Modules, lowest first (each imports only those above it in this list, never this package):

    task        the task: words, length laws, checker, mistakes, records made without a model
    tokenizer   the task's tokenizer (one token a word)
    assets      ASSET_VERSION, LearnSpec, LearnAssets, JSONL I/O, the splits (`write_data`)
    evaluation  scoring and sampling models; a policy's figures, the SFT baseline, held-out actors
    rollouts    a run's rollouts.jsonl read back: trained samples, lengths, exact match
    shipped     the builds shipped in the package (`install`, `build`): every machine trains the same models
"""

from __future__ import annotations

from openrlhf_oppo.tasks.learn.assets import (
    ASSET_VERSION,
    DEFAULT_ASSETS_DIR,
    TRAIN_DTYPES,
    VARIANTS,
    LearnAssets,
    LearnSpec,
    build_marker,
    default_root,
    read_jsonl,
    write_data,
    write_jsonl,
)
from openrlhf_oppo.tasks.learn.shipped import build
from openrlhf_oppo.tasks.learn.task import (
    ARROW,
    MISTAKES,
    OP,
    RESPONSE_CAP,
    WORDS,
    LengthLaw,
    answer,
    answer_words,
    exact_match,
    make_prompt,
    mistake,
    parse_prompt,
    preference_pairs,
    prompt_records,
    sft_records,
)
from openrlhf_oppo.tasks.learn.tokenizer import build_tokenizer

__all__ = [
    "ARROW", "ASSET_VERSION", "DEFAULT_ASSETS_DIR", "MISTAKES", "OP", "RESPONSE_CAP", "TRAIN_DTYPES", "VARIANTS",
    "WORDS", "LearnAssets", "LearnSpec", "LengthLaw", "answer", "answer_words", "build", "build_marker",
    "build_tokenizer", "default_root", "exact_match", "make_prompt", "mistake", "parse_prompt",
    "preference_pairs", "prompt_records", "read_jsonl", "sft_records", "write_data", "write_jsonl",
]
