"""SmolLM2-135M-Instruct as a generative judge (reward.judge): an hf rollout service on loopback serves it, a
reward service calls it for arithmetic rows.

Its scores equal a direct transformers greedy generation of the same judge prompt (the template rendered, then
SmolLM2's chat template), parsed with the same rule; a verdict the strict rule cannot read fails its item,
counted; the judge stopped in the middle of a Score call fails the items it had not judged, and the service goes
on scoring. One judge service for the module, stopped by the last test.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from rlfabric.core.client import ChannelOptions
from rlfabric.core.config import RunConfig, load_config
from rlfabric.core.server import ServerOptions
from rlfabric.reward.arithmetic import DATA_SOURCE
from rlfabric.reward.engine import RewardEngine
from rlfabric.reward.items import STATUS_ERROR, STATUS_OK, ScoreItem
from rlfabric.reward.judge import JUDGE_FAILED, JudgeFailure, parse_score, render
from rlfabric.rollout.servicer import build_service as build_rollout
from tests.conftest import ServerThread
from tests.waiting import wait_until
from tests.weight_sync.helpers import Loop

pytestmark = pytest.mark.slow

TEMPLATE = ("Grade the answer to a math question.\nQuestion: {prompt}\nAnswer: {response}\nReference: {ground_truth}\n"
            "Reply in the form 'Score: N', with N from 0 to 10. Example reply: Score: 7")
# SmolLM2-135M seldom writes "Score: N" as asked; this rule reads the number after "Score:", else the first one, so
# that most verdicts parse (the strict default rule is the unparseable case).
LENIENT = r"(?:Score:\s*)?(\d+)"
ROWS = [("What is 2 + 3?", "5", "5"), ("What is 7 + 6?", "12", "13"), ("What is 4 + 4?", "8", "8"),
        ("What is 9 + 1?", "The answer is 10.", "10")]
MAX_TOKENS = 8


def items() -> list[ScoreItem]:
    return [ScoreItem(DATA_SOURCE, response, truth, prompt=question) for question, response, truth in ROWS]


def reward_config(address: str, *overrides: str) -> RunConfig:
    return load_config(None, [f"reward.judge.addresses=[{address}]", f"reward.judge.data_sources=[{DATA_SOURCE}]",
                              f"reward.judge.prompt_template={json.dumps(TEMPLATE)}", f"reward.judge.max_tokens={MAX_TOKENS}",
                              "reward.judge.batch_size=2", "reward.judge.max_concurrency=2", *overrides])


@pytest.fixture(scope="module")
def judge(smollm2):
    """The judge: SmolLM2 behind an hf rollout service (float32, as the direct generation)."""
    service = build_rollout(load_config(None, [f"model.path={smollm2}", "rollout.dtype=float32",
                                               "rollout.max_num_seqs=8"]))
    server = ServerThread(service, ServerOptions(port=0, metrics_port=None))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def direct_verdicts(smollm2) -> list[str]:
    """Each row's verdict from transformers' own greedy generate, on the judge prompt as the service renders it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    verdicts = []
    for item in items():
        messages = [{"role": "user", "content": render(TEMPLATE, item)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS)
        verdicts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return verdicts


class Reward:
    """A RewardEngine in this process (on its own loop thread) calling the judge over gRPC."""

    def __init__(self, config: RunConfig):
        self.loop = Loop()
        self.engine = RewardEngine(config.reward, judge_options=ChannelOptions(retry_max_attempts=1))
        self.loop.run(self.engine.start())

    def score(self, batch: list[ScoreItem]):
        return self.loop.run(self.engine.score(batch), timeout=300)

    def failures(self, reason: str) -> float:
        return self.engine._judge_failures_total.labels(reason=reason)._value.get()

    def close(self) -> None:
        self.loop.run(self.engine.stop())
        self.loop.stop()


@pytest.fixture
def reward():
    made: list[Reward] = []

    def make(config: RunConfig) -> Reward:
        made.append(Reward(config))
        return made[-1]

    yield make
    for one in made:
        one.close()


def test_judge_scores_equal_a_direct_greedy_generation(judge, direct_verdicts, reward):
    lenient = reward(reward_config(judge.address, f"reward.judge.regex={json.dumps(LENIENT)}"))
    rule_item = ScoreItem("openai/gsm8k", "so #### 72", "72")  # mixed in: the rules score it
    results = lenient.score([*items(), rule_item])
    config = lenient.engine.config.judge
    expected = []
    for verdict in direct_verdicts:
        try:
            expected.append((STATUS_OK, parse_score(verdict, config)))
        except JudgeFailure:
            expected.append((STATUS_ERROR, 0.0))
    assert [(r.status, r.score) for r in results[:-1]] == expected, direct_verdicts
    assert sum(status == STATUS_OK for status, _ in expected) >= 2, direct_verdicts  # the check compares scores
    assert (results[-1].status, results[-1].score) == (STATUS_OK, 1.0)
    assert lenient.engine.judge.requests == 2  # four judged items in requests of judge.batch_size 2


def test_unparseable_verdicts_fail_and_are_counted(judge, direct_verdicts, reward):
    strict = reward(reward_config(judge.address))  # the default regex: "Score: N" only
    unreadable = []
    for verdict in direct_verdicts:
        try:
            parse_score(verdict, strict.engine.config.judge)
        except JudgeFailure:
            unreadable.append(True)
        else:
            unreadable.append(False)
    assert any(unreadable), direct_verdicts
    results = strict.score(items())
    assert [not r.ok for r in results] == unreadable
    for result, verdict in zip(results, direct_verdicts, strict=True):
        assert result.metrics[JUDGE_FAILED] == float(not result.ok)
        if not result.ok:
            assert result.status == STATUS_ERROR and "unparseable" in result.message and repr(verdict) in result.message
    assert strict.failures("unparseable") == sum(unreadable)
    assert strict.engine.status().items_failed == sum(unreadable)


def test_judge_stopped_mid_call_fails_the_rest_and_scoring_goes_on(judge, reward):
    """Last: it stops the module's judge. One item per request, one request at a time; the judge stops once the
    first has been judged: the items it had not judged fail (masked and counted), the call returns, and the next
    Score call is answered too."""
    one_by_one = reward(reward_config(judge.address, f"reward.judge.regex={json.dumps(LENIENT)}", "reward.judge.batch_size=1",
                                      "reward.judge.max_concurrency=1", "reward.judge.timeout_s=60"))
    out: dict = {}
    call = threading.Thread(target=lambda: out.update(results=one_by_one.score(items())))
    call.start()
    wait_until(lambda: one_by_one.engine.judge.requests >= 2, 120, "the judge's second request")
    judge.stop()
    call.join(120)
    assert not call.is_alive()
    results = out["results"]
    assert results[0].metrics[JUDGE_FAILED] == 0.0  # judged before the stop
    failed = [r for r in results if r.metrics[JUDGE_FAILED] == 1.0]
    assert len(failed) >= 2  # the last two were never sent to a running judge
    assert all(r.status == STATUS_ERROR and r.message.startswith("judge: ") for r in failed)
    counted = sum(one_by_one.failures(reason) for reason in ("unavailable", "error", "timeout"))
    assert counted == len(failed)

    after = one_by_one.score([items()[0], ScoreItem("openai/gsm8k", "so #### 72", "72")])
    assert after[0].status == STATUS_ERROR and "UNAVAILABLE" in after[0].message
    assert (after[1].status, after[1].score) == (STATUS_OK, 1.0)
