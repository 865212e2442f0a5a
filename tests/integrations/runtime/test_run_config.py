"""run_config: whether the engines detokenise."""

from __future__ import annotations

from openrlhf_oppo.integrations.runtime import openrlhf_executor
from openrlhf_oppo.integrations.runtime.run_config import engine_text_needed


def test_detokenisation_is_off_by_default_and_with_a_rule_reward_which_decodes_token_ids_itself(fakes):
    assert engine_text_needed(fakes.make_args()) is False
    # OpenRLHF's SingleTurnAgentExecutor (and OPPO's rule path) decode the token ids with the tokenizer
    assert engine_text_needed(fakes.make_args(remote_url="/reward.py")) is False


def test_detokenisation_is_on_when_an_agent_reads_the_engines_text(fakes):
    args = fakes.make_args()
    args.train.agent_func_path = "/agent.py"  # OpenRLHF's multi-turn executor hands `outputs[0].text` to it
    assert engine_text_needed(args) is True


def test_the_sampling_params_carry_the_choice_and_default_to_openrlhfs():
    kwargs = {"max_new_tokens": 8}
    assert openrlhf_executor.sampling_params(kwargs, False, detokenize=False).detokenize is False
    assert openrlhf_executor.sampling_params(kwargs, False).detokenize is True  # OpenRLHF's own: text on
