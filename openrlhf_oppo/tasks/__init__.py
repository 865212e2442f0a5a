"""The built-in tiny task: a tokenizer, tiny Qwen2-style models and a prompt set,
all built in code (no model hub). See `openrlhf_oppo.tasks.tiny`."""
