"""A finished sample's rule-based reward, as the OPPO rollout engine gets it
(`OppoRolloutActor._reward`): through OpenRLHF 0.11.2's own `SingleTurnAgentExecutor` reward
code, from a `.py` reward function or a real HTTP server on 127.0.0.1. Only the engine's
two attributes the method reads (its executor and its tokenizer) are set up; no vLLM."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from openrlhf_oppo import compat

compat.apply()
agent = pytest.importorskip("openrlhf.utils.agent")

from openrlhf_oppo.integrations.runtime.rollout import OppoRolloutActor, SampleRequest  # noqa: E402


class _Tokenizer:
    """Decodes ids as space-joined numbers: enough to see the query is prompt + response."""

    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens is False  # OpenRLHF's executor decodes with special tokens
        return " ".join(map(str, ids))


def _reward(executor, prompt_ids, tokens, prompt="p", label="3"):
    engine = SimpleNamespace(executor=executor, _reward_tokenizer=_Tokenizer())
    req = SampleRequest(7, prompt_ids, [], 16, None, (prompt, label))
    return asyncio.run(OppoRolloutActor._reward(engine, req, tokens))


class _Server(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        data = json.dumps({"rewards": [len(q.split()) / 10 for q in body["query"]], "scores": [1.0],
                           "extra_logs": {"words": [3.0]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}/get_reward"
    srv.shutdown()


def test_http_endpoint_scores_the_query_openrlhf_sends(server):
    _Server.bodies.clear()
    info, error = _reward(agent.SingleTurnAgentExecutor(server), [5, 6], [7, 8, 9], prompt="five six", label="3")
    assert error is None
    assert _Server.bodies == [{"query": ["5 6 7 8 9"], "prompts": ["five six"], "labels": ["3"]}]
    assert info == {"reward": 0.5, "scores": 1.0, "extra_logs": {"words": 3.0}}


def test_py_reward_function_scores_the_query(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("import torch\n"
                    "def reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': torch.tensor([float(len(queries[0].split()))]), 'scores': None}\n")
    info, error = _reward(agent.SingleTurnAgentExecutor(str(path)), [1], [2, 3])
    assert error is None and info == {"reward": 3.0, "scores": 3.0, "extra_logs": {}}  # scores default to rewards


def test_a_failing_endpoint_is_reported_not_trained(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    raise RuntimeError('bad label')\n")
    info, error = _reward(agent.SingleTurnAgentExecutor(str(path)), [1], [2])
    assert info is None and "bad label" in error and str(path) in error
