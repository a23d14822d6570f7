"""RewardService on a real loopback server: rule-based scores equal the library's, validation
errors are INVALID_ARGUMENT naming the item (and nothing is scored), the service keeps serving."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import grpc
import pytest

from rlfabric.core.config import RewardConfig
from rlfabric.core.errors import InvalidArgument, Unavailable
from rlfabric.quickstart.tiny_model import build_tokenizer
from rlfabric.reward import STATUS_OK, ScoreItem, compute_score, register_scorer
from rlfabric.reward.client import LocalRewardClient, RewardClient, ShardedRewardClient
from rlfabric.reward.engine import RewardEngine
from rlfabric.v1 import reward_pb2

GSM8K = "openai/gsm8k"
MATH = "lighteval/MATH"
ITEMS = [
    ScoreItem(GSM8K, "She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ScoreItem(GSM8K, "So the total is #### 1,200", "1200"),
    ScoreItem(GSM8K, "The answer is 72", "72"),  # strict: no "####"
    ScoreItem(GSM8K, "#### 71", "72"),
    ScoreItem(MATH, "so $\\boxed{\\frac{1}{2}}$", "0.5"),
    ScoreItem(MATH, "\\boxed{3}", "\\frac{6}{2}"),
    ScoreItem("HuggingFaceH4/MATH-500", "$x = \\boxed{\\dfrac{3}{4}}$", "\\frac34"),
    ScoreItem(MATH, "no box here", "1"),
]


def library_scores(items, **kwargs) -> list[float]:
    return [compute_score(i.data_source, i.response, i.ground_truth, i.extra_info, **kwargs) for i in items]


def gsm8k_item(index: int = 0) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(data_source=GSM8K, response=f"#### {index}", ground_truth=str(index))


@pytest.fixture
def rule_based(reward_server):
    return reward_server()


def assert_still_serving(server) -> None:
    results = server.score([ScoreItem(GSM8K, "#### 5", "5")])
    assert [(r.status, r.score) for r in results] == [(STATUS_OK, 1.0)]


# --- rule-based scoring ---


def test_gsm8k_and_math_scores_equal_the_library(rule_based):
    results = rule_based.score(ITEMS)
    assert [r.status for r in results] == [STATUS_OK] * len(ITEMS)
    assert [r.score for r in results] == library_scores(ITEMS)
    assert sorted(set(r.score for r in results)) == [0.0, 1.0]  # both outcomes are covered


def test_compute_score_kwargs_reach_the_scorer(reward_server):
    server = reward_server(compute_score_kwargs={"method": "flexible", "format_score": 0.1})
    expected = library_scores(ITEMS[:4], method="flexible", format_score=0.1)
    assert [r.score for r in server.score(ITEMS[:4])] == expected
    assert expected[2] == 1.0  # flexible finds "72" without "####"


def test_status_and_items_metric_count_scored_items(rule_based):
    before = rule_based.status()
    assert {GSM8K, MATH} <= set(before.data_sources)
    rule_based.score(ITEMS)
    after = rule_based.status()
    assert after.items_scored - before.items_scored == len(ITEMS) and after.items_failed == 0
    assert rule_based.metric("rlfabric_reward_items_total") == after.items_scored
    assert rule_based.metric("rlfabric_reward_failures_total", reason="error") == 0.0


def test_scorer_registered_after_start_is_used(rule_based):
    source = f"test/late-{uuid.uuid4().hex[:8]}"
    register_scorer(source, lambda solution, truth, extra_info, **kw: len(solution) / 10)
    assert [r.score for r in rule_based.score([ScoreItem(source, "abcd", "")])] == [0.4]
    assert source in rule_based.status().data_sources


def test_scorer_modules_are_imported_at_start(reward_server, tmp_path, monkeypatch):
    name = f"my_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "from rlfabric.reward import register_scorer\n"
        f"register_scorer('{name}/task', lambda s, gt, extra_info, **kw: float(s.strip() == gt))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    server = reward_server(scorer_modules=[name])
    assert f"{name}/task" in server.status().data_sources
    assert [r.score for r in server.score([ScoreItem(f"{name}/task", " b ", "b")])] == [1.0]


def test_overlong_penalty_from_token_count(reward_server):
    server = reward_server(overlong_enable=True, overlong_max_response_length=8, overlong_buffer_length=4)
    items = [
        ScoreItem(GSM8K, "#### 7", "7", response_length=4),  # no penalty up to Lmax - b
        ScoreItem(GSM8K, "#### 7", "7", response_length=6),  # -(6 - 4) / 4
        ScoreItem(GSM8K, "#### 7", "7", response_token_ids=[1] * 8),  # length 0 = len(token ids)
    ]
    results = server.score(items)
    assert [r.score for r in results] == [1.0, 0.5, 0.0]
    assert [r.metrics["overlong"] for r in results] == [0.0, 1.0, 1.0]


def test_event_loop_stays_responsive_while_scoring(rule_based):
    source = f"test/slow-{uuid.uuid4().hex[:8]}"
    scoring = threading.Event()

    def slow_scorer(*args, **kwargs) -> float:
        scoring.set()
        time.sleep(0.8)  # the slow scorer is the subject: the loop must answer while it runs
        return 1.0

    register_scorer(source, slow_scorer)
    slow = threading.Thread(target=rule_based.score, args=([ScoreItem(source, "", "")],))
    slow.start()
    assert scoring.wait(timeout=30)
    start = time.monotonic()
    rule_based.status()  # answered while the slow batch is still being scored
    assert time.monotonic() - start < 0.4
    assert slow.is_alive()
    slow.join()


# --- validation: INVALID_ARGUMENT naming the item, nothing scored, still serving ---


def test_unknown_data_source_names_item_and_scores_nothing(rule_based):
    before = rule_based.status().items_scored
    error = rule_based.raw_error(
        [gsm8k_item(1), gsm8k_item(2), gsm8k_item(3), reward_pb2.ScoreItem(data_source="foo")]
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 3: unknown data_source 'foo'; registered:" in error.details() and GSM8K in error.details()
    assert rule_based.status().items_scored == before  # all or nothing
    with pytest.raises(InvalidArgument, match="unknown data_source 'foo'"):  # the typed client's view
        rule_based.score([ScoreItem("foo", "", "")])
    assert_still_serving(rule_based)


def test_default_score_for_unknown(reward_server):
    server = reward_server(default_score_for_unknown=-0.5)
    results = server.score([ScoreItem("foo", "#### 1", "1"), ScoreItem(GSM8K, "#### 1", "1")])
    assert [(r.status, r.score) for r in results] == [(STATUS_OK, -0.5), (STATUS_OK, 1.0)]
    assert "default score used" in results[0].message


@pytest.mark.parametrize(
    ("extra_info_json", "expected"),
    [
        ("[1, 2]", "item 1: extra_info_json must be a JSON object, got a list"),
        ("{oops", "item 1: extra_info_json is not valid JSON"),
    ],
)
def test_extra_info_must_be_a_json_object(rule_based, extra_info_json, expected):
    bad = reward_pb2.ScoreItem(
        data_source=GSM8K, response="#### 1", ground_truth="1", extra_info_json=extra_info_json
    )
    error = rule_based.raw_error([gsm8k_item(), bad])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in error.details()
    assert_still_serving(rule_based)


def test_extra_info_reaches_the_scorer(rule_based):
    source = f"test/extra-{uuid.uuid4().hex[:8]}"
    register_scorer(source, lambda solution, truth, extra_info, **kw: extra_info["weight"] * 2)
    assert [r.score for r in rule_based.score([ScoreItem(source, "", "", extra_info={"weight": 0.25})])] == [
        0.5
    ]


def test_empty_request_is_invalid(rule_based):
    error = rule_based.raw_error([])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least one item" in error.details()
    assert_still_serving(rule_based)


def test_too_many_items_is_resource_exhausted(reward_server):
    server = reward_server(max_items_per_request=10)
    error = server.raw_error([gsm8k_item(i) for i in range(11)])
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "11 items" in error.details() and "max_items_per_request=10" in error.details()
    assert [r.score for r in server.score([ScoreItem(GSM8K, f"#### {i}", str(i)) for i in range(10)])] == [
        1.0
    ] * 10


def test_token_ids_without_tokenizer_are_invalid(rule_based):
    error = rule_based.raw_error(
        [gsm8k_item(), reward_pb2.ScoreItem(data_source=GSM8K, response_token_ids=[5, 6])]
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "item 1: response is empty and response_token_ids needs a tokenizer" in error.details()
    # Token ids next to the text are fine: the text is scored, the ids only give the length.
    assert rule_based.score([ScoreItem(GSM8K, "#### 4", "4", response_token_ids=[5, 6])])[0].score == 1.0


# --- token ids decoded with the tiny model's tokenizer ---


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


def test_token_ids_are_decoded_with_the_tokenizer(reward_server, tokenizer_dir):
    server = reward_server(tokenizer_path=str(tokenizer_dir))
    tokenizer = build_tokenizer()
    texts = ["She has 7 apples.\n#### 7<|im_end|>", "#### 8<|im_end|><|endoftext|>", "so 9"]
    items = [
        ScoreItem(GSM8K, "", truth, response_token_ids=tokenizer(text)["input_ids"])
        for text, truth in zip(texts, ["7", "9", "9"], strict=True)
    ]
    assert [r.score for r in server.score(items)] == [1.0, 0.0, 0.0]
    # Special tokens are dropped, as VeRL decodes: "#### 8" then end of turn matches "8".
    assert (
        server.score([ScoreItem(GSM8K, "", "8", response_token_ids=items[1].response_token_ids)])[0].score
        == 1.0
    )

    error = server.raw_error(
        [gsm8k_item(), reward_pb2.ScoreItem(data_source=GSM8K, response_token_ids=[5, len(tokenizer)])]
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        f"item 1: response_token_ids holds {len(tokenizer)}, outside the tokenizer's vocabulary"
        in error.details()
    )
    error = server.raw_error([reward_pb2.ScoreItem(data_source=GSM8K, response_token_ids=[-1])])
    assert "item 0: response_token_ids holds -1" in error.details()
    assert_still_serving(server)


# --- the three client kinds give the same results ---


def test_local_and_sharded_clients_match_the_grpc_client(reward_server):
    servers = [reward_server(), reward_server()]
    items = ITEMS * 5  # 40 items: 6 requests of 7 over 2 replicas
    expected = [r.score for r in servers[0].score(items)]

    async def through_clients():
        engine = RewardEngine(RewardConfig())
        await engine.start()
        local = await LocalRewardClient(engine).score(items)
        async with ShardedRewardClient.connect([s.address for s in servers], request_items=7) as sharded:
            scores = await sharded.score(items)
            with pytest.raises(
                InvalidArgument, match=r"items 35\.\.39 of the batch: .*item 2: unknown data_source"
            ):
                await sharded.score([*items[:37], ScoreItem("foo", "", ""), *items[38:]])
            status = await sharded.status()
        await engine.stop()
        return local, scores, status

    local, sharded, status = asyncio.run(through_clients())
    assert [r.score for r in local] == expected and [r.score for r in sharded] == expected
    # Requests 0, 2, 4 (21 items) go to replica 0, requests 1, 3, 5 (19) to replica 1; in the refused
    # batch replica 1's last request fails and its other two (14 items) are scored anyway.
    assert [s.status().items_scored for s in servers] == [40 + 21 + 21, 19 + 14]
    assert status.items_scored == 40 + 21 + 21 + 19 + 14


def test_client_refuses_a_non_string_ground_truth(rule_based):
    async def send():
        async with RewardClient(rule_based.address) as client:
            await client.score([ScoreItem(GSM8K, "#### 1", "1"), ScoreItem(GSM8K, "#### 1", 1)])

    with pytest.raises(InvalidArgument, match="item 1: ground_truth must be a string"):
        asyncio.run(send())


def test_engine_refuses_to_score_before_start():
    with pytest.raises(Unavailable, match="not started"):
        asyncio.run(LocalRewardClient(RewardEngine(RewardConfig())).score(ITEMS))
