"""Custom reward functions in the worker pool: results, failures per item, and recovery."""

import os
import textwrap
import time

import pytest

from rlfabric.reward import (
    STATUS_CRASHED,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    CustomFunctionLoadError,
    CustomScorerPool,
    OverlongConfig,
    ScoreItem,
    ScoringConfig,
    score_items,
)

TIMEOUT_S = 1.0

USER_FILE = textwrap.dedent(
    """
    import ctypes
    import os
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info, bonus=0.0):
        mode = (extra_info or {}).get("mode", "exact")
        if mode == "exact":
            return float(solution_str == ground_truth) + bonus
        if mode == "dict":
            return {"score": 0.5, "length": len(solution_str), "exact": solution_str == ground_truth,
                    "note": "not a number", "pid": os.getpid()}
        if mode == "echo":
            return {"score": 1.0, "n": extra_info["nested"]["n"], "source_len": len(data_source)}
        if mode == "raise":
            raise ValueError("cannot parse the answer")
        if mode == "sleep":
            time.sleep(60)
        if mode == "loop":
            while True:
                pass
        if mode == "exit":
            os._exit(3)
        if mode == "segfault":
            ctypes.string_at(0)
        if mode == "hog":  # address space (RLIMIT_AS): bytes() maps zero pages it does not touch, so the limit
            chunks = []    # is met at once, not after seconds of page faults on a loaded machine
            while True:
                chunks.append(bytes(16 * 1024 * 1024))
        if mode == "print":
            print("chatter on stdout that must not break the protocol")
            return 1.0
        if mode == "nan":
            return float("nan")
        if mode == "text":
            return "1.0"
        raise AssertionError(mode)
    """
)


def item(mode: str, response: str = "42", ground_truth: str = "42", **extra) -> ScoreItem:
    return ScoreItem("my/task", response, ground_truth, extra_info={"mode": mode, **extra})


def normal_batch() -> list[ScoreItem]:
    return [item("exact"), item("exact", response="41"), item("exact"), item("exact", response="x")]


def assert_normal_batch_works(pool: CustomScorerPool) -> None:
    results = pool.score_batch(normal_batch())
    assert [r.status for r in results] == [STATUS_OK] * 4
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]


def worker_pid(pool: CustomScorerPool) -> int:
    return int(pool.score_batch([item("dict")])[0].metrics["pid"])


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


@pytest.fixture(scope="module")
def pool(user_file):
    with CustomScorerPool(
        user_file, "compute_score", num_workers=2, timeout_s=TIMEOUT_S, memory_limit_mb=512
    ) as pool:
        yield pool


def test_float_results(pool):
    assert_normal_batch_works(pool)


def test_runs_in_another_process(pool):
    assert worker_pid(pool) != os.getpid()


def test_dict_result_numeric_keys_become_metrics(pool):
    result = pool.score_batch([item("dict", response="abc", ground_truth="abc")])[0]
    assert result.status == STATUS_OK and result.score == 0.5
    assert result.metrics["length"] == 3.0 and result.metrics["exact"] == 1.0
    assert "note" not in result.metrics and "score" not in result.metrics


def test_arguments_reach_the_function(pool):
    result = pool.score_batch([item("echo", nested={"n": 7})])[0]
    assert result.metrics == {"n": 7.0, "source_len": float(len("my/task"))}


def test_stdout_prints_do_not_break_the_protocol(pool):
    results = pool.score_batch([item("print"), item("exact")])
    assert [(r.status, r.score) for r in results] == [(STATUS_OK, 1.0), (STATUS_OK, 1.0)]


def test_bad_return_values_are_errors(pool):
    results = pool.score_batch([item("nan"), item("text")])
    assert [r.status for r in results] == [STATUS_ERROR, STATUS_ERROR]
    assert "non-finite" in results[0].message and "str" in results[1].message
    assert_normal_batch_works(pool)


def test_item_that_cannot_be_sent_is_an_error(pool):
    results = pool.score_batch([item("exact", blob=object()), item("exact")])
    assert results[0].status == STATUS_ERROR and "JSON" in results[0].message
    assert results[1].status == STATUS_OK and results[1].score == 1.0


@pytest.mark.parametrize(
    ("mode", "status", "message"),
    [
        ("raise", STATUS_ERROR, "ValueError: cannot parse the answer"),
        ("hog", STATUS_ERROR, "MemoryError"),
        ("sleep", STATUS_TIMEOUT, "no result within 1 s"),
        ("loop", STATUS_TIMEOUT, "no result within 1 s"),
        ("exit", STATUS_CRASHED, "exited with code 3"),
        ("segfault", STATUS_CRASHED, "SIGSEGV"),
    ],
)
def test_failure_scores_zero_and_pool_recovers(pool, mode, status, message):
    start = time.monotonic()
    result = pool.score_batch([item(mode)])[0]
    elapsed = time.monotonic() - start
    assert result.status == status
    assert result.score == 0.0
    assert message in result.message
    assert elapsed < TIMEOUT_S + 3.0  # a hung item is cut off, not waited for
    assert_normal_batch_works(pool)


def test_mixed_batch_statuses_per_item(pool):
    items = [
        item("exact"),
        item("sleep"),
        item("exact", response="1"),
        item("exit"),
        item("raise"),
        item("dict"),
        item("loop"),
        item("exact"),
    ]
    results = pool.score_batch(items)
    assert [r.status for r in results] == [
        STATUS_OK,
        STATUS_TIMEOUT,
        STATUS_OK,
        STATUS_CRASHED,
        STATUS_ERROR,
        STATUS_OK,
        STATUS_TIMEOUT,
        STATUS_OK,
    ]
    assert [r.score for r in results] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 1.0]
    assert_normal_batch_works(pool)


@pytest.mark.parametrize("mode", ["loop", "exit", "hog"])
def test_hung_dead_or_out_of_memory_worker_is_replaced(user_file, mode):
    with CustomScorerPool(user_file, num_workers=1, timeout_s=TIMEOUT_S, memory_limit_mb=512) as pool:
        old_pid = worker_pid(pool)
        assert pool.score_batch([item(mode)])[0].status != STATUS_OK
        new_pid = worker_pid(pool)
        assert new_pid != old_pid
        assert not process_exists(old_pid)  # killed and reaped, not left spinning
    assert not process_exists(new_pid)  # close() kills the workers


def test_function_kwargs(user_file):
    with CustomScorerPool(user_file, num_workers=1, function_kwargs={"bonus": 0.25}) as pool:
        assert pool.score_batch([item("exact")])[0].score == 1.25


def test_score_items_routes_everything_to_the_pool(pool):
    overlong = OverlongConfig(enable=True, max_response_length=100, buffer_length=20)
    items = [
        ScoreItem("openai/gsm8k", "42", "42", extra_info={"mode": "exact"}, response_length=90),
        item("raise"),
    ]
    results = score_items(items, ScoringConfig(overlong=overlong), custom_pool=pool)
    assert results[0].score == pytest.approx(0.5)  # the user's 1.0 plus the -0.5 overlong penalty
    assert results[1].status == STATUS_ERROR and results[1].score == 0.0


def test_closed_pool_refuses_work(user_file):
    pool = CustomScorerPool(user_file, num_workers=1)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_batch([item("exact")])


@pytest.mark.parametrize(
    ("source", "name", "message"),
    [
        ("def other(*args):\n    return 1.0\n", "compute_score", "has no function 'compute_score'"),
        ("def compute_score(:\n", "compute_score", "SyntaxError"),
        ("compute_score = 3\n", "compute_score", "not a function"),
        ("import os\nos._exit(5)\n", "compute_score", "exited with code 5"),
    ],
)
def test_load_errors_raise_at_construction(tmp_path, source, name, message):
    path = tmp_path / "broken_reward.py"
    path.write_text(source)
    with pytest.raises(CustomFunctionLoadError, match=message):
        CustomScorerPool(str(path), name, num_workers=1)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        CustomScorerPool(str(tmp_path / "nope.py"))
