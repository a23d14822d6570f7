"""Every request-validating RPC of every service, fed malformed requests by hypothesis, on real
servers (the tiny model) on loopback:

- raw bytes as the serialized request: random bytes, and truncated / overwritten / extended copies
  of a valid request (sent through a generic channel call, no serializer);
- well-formed messages with wrong dtypes, shapes, huge dims, NaN/inf, empty batches, unknown or
  missing tensors, unicode garbage in text fields, out-of-range numbers.

Every answer is OK (where the input happens to be valid, and then the answer is checked too) or a
clean refusal (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED) with a message, never
INTERNAL or UNKNOWN, and it comes back within a bound. After each batch the service still reports
readiness SERVING and answers a valid request correctly.

Hypothesis runs derandomized (a fixed example sequence, no example database), so CI is reproducible.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlfabric.core import codec
from rlfabric.core.config import RewardConfig, RunConfig, config_from_dict
from rlfabric.reward.servicer import build_service as build_reward_service
from rlfabric.rollout.servicer import build_service as build_rollout_service
from rlfabric.serve import build_service as build_role_service
from rlfabric.serve import build_service as build_trainer_service
from rlfabric.v1 import (
    actor_pb2,
    common_pb2,
    coordinator_pb2,
    critic_pb2,
    reference_pb2,
    reward_pb2,
    rollout_pb2,
    tensor_pb2,
)

from .helpers import (
    ACTOR_LOG_PROBS,
    COMPUTE_VALUES,
    GENERATE,
    GENERATE_STREAM,
    PUSH_WEIGHTS,
    REFERENCE_LOG_PROBS,
    SCORE,
    SERVING,
    START_RUN,
    UPDATE_POLICY,
    UPDATE_VALUES,
    Method,
    assert_clean,
    call_raw,
    good_generate_request,
    good_score_request,
    good_trainer_tensors,
    health,
    push_weights_payload,
    sequence_batch,
    start_run_request,
    trainer_config,
    trainer_request,
)

VOCAB = 100  # the tiny model's
MAX_LEN = 512  # its max_position_embeddings


TRAINER_METHODS = [ACTOR_LOG_PROBS, UPDATE_POLICY, REFERENCE_LOG_PROBS, COMPUTE_VALUES, UPDATE_VALUES]
ALL_METHODS = [SCORE, GENERATE, GENERATE_STREAM, PUSH_WEIGHTS, *TRAINER_METHODS, START_RUN]
ROLE_OF_SERVICE = {"RewardService": "reward", "RolloutService": "rollout", "ActorService": "actor",
                   "ReferenceService": "reference", "CriticService": "critic", "CoordinatorService": "coordinator"}

FUZZ = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- the services, once per module --------------------------------------------------------------------


@pytest.fixture(scope="module")
def addresses(serve_module, tiny_model):
    """role -> address of a real service of that role."""
    trainers = trainer_config(tiny_model)
    # The coordinator has no model.path: a StartRun that passes validation stops at FAILED_PRECONDITION
    # ("model.path is empty") instead of starting a run against services that do not exist.
    coordinator = config_from_dict({"rollout": {"n": 2},
                                    "trainer": {"run_dir": str(Path(tiny_model).parent / "coordinator-run")}})
    services = {
        "reward": build_reward_service(RunConfig(reward=RewardConfig(max_items_per_request=64))),
        "rollout": build_rollout_service(config_from_dict({"model": {"path": str(tiny_model)}})),
        "actor": build_trainer_service("actor", trainers),
        "reference": build_trainer_service("reference", trainers),
        "critic": build_trainer_service("critic", trainers),
        "coordinator": build_role_service("coordinator", coordinator),
    }
    return {role: serve_module(service).address for role, service in services.items()}


def address_of(addresses, method: Method) -> str:
    return addresses[ROLE_OF_SERVICE[method.service.removeprefix("rlfabric.v1.")]]


# --- after each batch: still serving, and a valid request still answered correctly --------------------


def valid_payload(method: Method):
    """Serialized known-good request (a list of messages for the client stream)."""
    if method == SCORE:
        return good_score_request().SerializeToString()
    if method == GENERATE:
        return good_generate_request().SerializeToString()
    if method == GENERATE_STREAM:
        return good_generate_request(rollout_pb2.RolloutServiceGenerateStreamRequest).SerializeToString()
    if method == PUSH_WEIGHTS:
        return push_weights_payload()
    if method == START_RUN:
        return start_run_request("trainer.total_steps=1").SerializeToString()
    return trainer_request(method, good_trainer_tensors(method)).SerializeToString()


def check_output_tensor(batch: tensor_pb2.Batch, name: str, shape: tuple[int, ...]) -> None:
    value = codec.to_torch(batch.tensors[name], name=name)
    assert tuple(value.shape) == shape and torch.isfinite(value).all(), (name, value)


def check_generated(samples, prompts: int, n: int, logprobs: bool) -> None:
    assert len(samples) == prompts * n
    assert sorted((s.prompt_index, s.sample_index) for s in samples) == [(p, i) for p in range(prompts) for i in range(n)]
    for sample in samples:
        assert all(0 <= t < VOCAB for t in sample.token_ids)
        assert sample.finish_reason != rollout_pb2.FINISH_REASON_UNSPECIFIED
        if logprobs:
            assert len(sample.logprobs) == len(sample.token_ids) and all(math.isfinite(x) and x <= 0 for x in sample.logprobs)


def assert_still_works(addresses, method: Method) -> None:
    """Health SERVING, and the known-good request of `method` gets its correct answer."""
    address = address_of(addresses, method)
    assert health(address) == SERVING, f"{method}: not SERVING after the fuzz batch"
    with grpc.insecure_channel(address) as channel:
        answer = call_raw(channel, method, valid_payload(method))
        if method == PUSH_WEIGHTS:  # a weight the model lacks: refused after the whole transport path
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and "not.a.weight" in answer.details
            method = GENERATE
            answer = call_raw(channel, method, valid_payload(method))
        if method == START_RUN:
            assert answer.code == grpc.StatusCode.FAILED_PRECONDITION and "model.path is empty" in answer.details
            return
        assert answer.code == grpc.StatusCode.OK, f"{method}: {answer.code.name}: {answer.details}"
    if method == SCORE:
        results = reward_pb2.RewardServiceScoreResponse.FromString(answer.responses[0]).results
        assert [r.score for r in results] == [1.0, 0.0]
    elif method == GENERATE:
        check_generated(rollout_pb2.RolloutServiceGenerateResponse.FromString(answer.responses[0]).samples, 1, 2, True)
    elif method == GENERATE_STREAM:
        check_generated([rollout_pb2.RolloutServiceGenerateStreamResponse.FromString(r).sample
                         for r in answer.responses], 1, 2, True)
    elif method in (ACTOR_LOG_PROBS, REFERENCE_LOG_PROBS):
        outputs = actor_pb2.ActorServiceComputeLogProbsResponse.FromString(answer.responses[0]).outputs
        check_output_tensor(outputs, "log_probs", (2, 3))
    elif method == COMPUTE_VALUES:
        outputs = critic_pb2.CriticServiceComputeValuesResponse.FromString(answer.responses[0]).outputs
        check_output_tensor(outputs, "values", (2, 3))
    elif method in (UPDATE_POLICY, UPDATE_VALUES):
        response = (actor_pb2.ActorServiceUpdatePolicyResponse if method == UPDATE_POLICY
                    else critic_pb2.CriticServiceUpdateValuesResponse)
        metrics = response.FromString(answer.responses[0]).metrics
        role = ROLE_OF_SERVICE[method.service.removeprefix("rlfabric.v1.")]
        assert math.isfinite(metrics[f"{role}/grad_norm"])


# --- 1. raw bytes -------------------------------------------------------------------------------------


def corrupted(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, or a valid request truncated, with bytes overwritten, or with bytes inserted."""

    def overwrite(edits):
        data = bytearray(valid)
        for position, value in edits:
            data[position % len(data)] = value
        return bytes(data)

    return st.one_of(
        st.binary(max_size=300),
        st.integers(0, max(0, len(valid) - 1)).map(lambda n: valid[:n]),
        st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4).map(overwrite),
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=16)).map(
            lambda cut: valid[: cut[0]] + cut[1] + valid[cut[0]:]),
    )


def bounded_generation(method: Method, payload: bytes) -> bool:
    """False for a corrupted Generate request that happens to parse into a huge valid one (a big n or
    max_tokens): the rollout service does not bound the rows of a request yet (see
    test_rollout_refuses_requests_with_too_many_rows), so such a request would just run for minutes."""
    if method not in (GENERATE, GENERATE_STREAM):
        return True
    cls = (rollout_pb2.RolloutServiceGenerateRequest if method == GENERATE
           else rollout_pb2.RolloutServiceGenerateStreamRequest)
    try:
        request = cls.FromString(payload)
    except DecodeError:
        return True
    rows = len(request.prompts) * max(request.sampling_params.n, 0)
    return rows * max(request.sampling_params.max_tokens, 0) <= 256


@pytest.mark.parametrize("method", ALL_METHODS, ids=str)
def test_corrupted_bytes_are_refused_cleanly(addresses, method):
    address = address_of(addresses, method)
    valid = valid_payload(method)
    if method.kind == "client_stream":  # the manifest or the chunk corrupted, or random messages
        manifest, chunk = valid
        payloads = st.one_of(corrupted(manifest).map(lambda m: [m, chunk]), corrupted(chunk).map(lambda c: [manifest, c]),
                             st.lists(corrupted(chunk), min_size=1, max_size=3))
    else:
        payloads = corrupted(valid)

    with grpc.insecure_channel(address) as channel:

        @FUZZ
        @given(payload=payloads)
        def fuzz(payload):
            assume(bounded_generation(method, payload))
            assert_clean(call_raw(channel, method, payload), f"{method} <- {payload!r}")

        fuzz()
    assert_still_works(addresses, method)


def test_bytes_that_are_not_a_message_name_the_problem(addresses):
    with grpc.insecure_channel(addresses["reward"]) as channel:
        answer = call_raw(channel, SCORE, b"\x0a\x03\x12\x01\xff")  # item.prompt holds invalid UTF-8
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in answer.details and "UTF-8" in answer.details


# --- 2. RewardService.Score ------------------------------------------------------------------------------

texts = st.text(max_size=30)  # any unicode: control characters, RTL marks, astral planes, NUL
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
score_items = st.builds(
    reward_pb2.ScoreItem,
    data_source=st.one_of(st.sampled_from(["openai/gsm8k", "lighteval/MATH", "rlfabric/find_vowel"]), texts),
    prompt=texts,
    response=st.one_of(texts, st.sampled_from(["#### 42", "\\boxed{42}", "#### " + "9" * 400])),
    response_token_ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    ground_truth=st.one_of(texts, st.just("42")),
    extra_info_json=st.one_of(st.just(""), texts, json_values.map(json.dumps)),
    response_length=st.integers(-(2**31), 2**31 - 1),
)


def test_score_structured_garbage(addresses):
    seen: set[grpc.StatusCode] = set()
    with grpc.insecure_channel(addresses["reward"]) as channel:

        @settings(FUZZ, max_examples=40)
        @given(items=st.lists(score_items, max_size=5))
        def fuzz(items):
            request = reward_pb2.RewardServiceScoreRequest(items=items)
            answer = call_raw(channel, SCORE, request.SerializeToString())
            assert_clean(answer, f"Score({items})")
            seen.add(answer.code)
            if answer.code == grpc.StatusCode.OK:
                results = reward_pb2.RewardServiceScoreResponse.FromString(answer.responses[0]).results
                assert len(results) == len(items)
                for result in results:
                    assert math.isfinite(result.score) and result.status != reward_pb2.SCORE_STATUS_UNSPECIFIED
            else:  # the refusal names the offending item, or says the request is empty
                assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer.details
                assert "item" in answer.details, answer.details

        fuzz()
    assert seen == {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}  # the strategy reaches both paths
    assert_still_works(addresses, SCORE)


# --- 3. RolloutService.Generate / GenerateStream --------------------------------------------------------

any_int64 = st.integers(-(2**63), 2**63 - 1)
any_int32 = st.integers(-(2**31), 2**31 - 1)
chat = st.lists(st.builds(common_pb2.ChatMessage, role=st.one_of(st.sampled_from(["user", "system"]), texts),
                          content=texts), min_size=1, max_size=2)
good_prompt = st.one_of(st.lists(st.integers(4, VOCAB - 1), min_size=1, max_size=6).map(
    lambda ids: rollout_pb2.Prompt(token_ids=ids)), chat.map(lambda messages: rollout_pb2.Prompt(messages=messages)))
bad_prompt = st.one_of(st.just(rollout_pb2.Prompt()), st.lists(any_int64, min_size=1, max_size=6).map(
    lambda ids: rollout_pb2.Prompt(token_ids=ids)), st.just(rollout_pb2.Prompt(token_ids=[5] * MAX_LEN)))
out_of_unit = st.floats(width=32).filter(lambda x: not 0 < x <= 1)  # NaN, inf, 0, negative, > 1

# Each field: (a valid value, a broken one). A request is valid except in the fields drawn as broken.
GENERATE_FIELDS = {
    "prompts": (st.lists(good_prompt, min_size=1, max_size=3),
                st.one_of(st.just([]), st.lists(st.one_of(good_prompt, bad_prompt), min_size=1, max_size=3))),
    "n": (st.integers(1, 3), st.integers(-(2**31), 0)),
    # NaN and inf temperatures are accepted today: test_rollout_refuses_non_finite_temperature.
    "temperature": (st.floats(0, 2, width=32), st.floats(max_value=-0.125, width=32, allow_infinity=False)),
    "top_p": (st.floats(0.125, 1, width=32), out_of_unit),
    "top_k": (st.integers(-1, 50), any_int32),
    "max_tokens": (st.integers(1, 3), st.one_of(st.integers(-(2**31), 0), st.sampled_from([MAX_LEN, 2**31 - 1]))),
    "stop": (st.lists(st.text(min_size=1, max_size=3), max_size=2), st.lists(st.text(max_size=3), min_size=1)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=2), st.lists(any_int64, min_size=1, max_size=2)),
    "seed": (st.one_of(st.none(), any_int64), st.one_of(st.none(), any_int64)),
    "logprobs": (st.booleans(), st.booleans()),
}


@st.composite
def generate_requests(draw, cls):
    broken = draw(st.sets(st.sampled_from(sorted(GENERATE_FIELDS)), max_size=3))
    value = {name: draw(bad if name in broken else good) for name, (good, bad) in GENERATE_FIELDS.items()}
    prompts = value.pop("prompts")
    return cls(prompts=prompts, sampling_params=rollout_pb2.SamplingParams(**value))


@pytest.mark.parametrize("method", [GENERATE, GENERATE_STREAM], ids=str)
def test_generate_structured_garbage(addresses, method):
    cls = (rollout_pb2.RolloutServiceGenerateRequest if method == GENERATE
           else rollout_pb2.RolloutServiceGenerateStreamRequest)
    seen: set[grpc.StatusCode] = set()
    with grpc.insecure_channel(addresses["rollout"]) as channel:

        @settings(FUZZ, max_examples=30 if method == GENERATE else 15)
        @given(request=generate_requests(cls))
        def fuzz(request):
            params = request.sampling_params
            answer = call_raw(channel, method, request.SerializeToString())
            assert_clean(answer, f"{method}({request})")
            seen.add(answer.code)
            if answer.code == grpc.StatusCode.OK:
                if method == GENERATE:
                    samples = rollout_pb2.RolloutServiceGenerateResponse.FromString(answer.responses[0]).samples
                else:
                    samples = [rollout_pb2.RolloutServiceGenerateStreamResponse.FromString(r).sample
                               for r in answer.responses]
                check_generated(samples, len(request.prompts), params.n, params.logprobs)
            else:
                assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer.details

        fuzz()
    assert seen == {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
    assert_still_works(addresses, method)


# --- 4. Actor / Reference / Critic batches ----------------------------------------------------------------

ALL_WIRE_DTYPES = [d for d in tensor_pb2.DataType.values()] + [99]  # UNSPECIFIED and an unknown value included
TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
HUGE = [2**31, 2**40, 2**40 + 1, 2**62, 2**63 - 1]
KNOWN_NAMES = ["input_ids", "attention_mask", "responses", "response_mask", "position_ids",
               "old_log_probs", "advantages", "ref_log_probs", "values", "returns"]
names = st.one_of(st.sampled_from(KNOWN_NAMES), st.sampled_from(KNOWN_NAMES[:4]), texts)  # mostly real ones


def _set_element(value: torch.Tensor, where: int, element) -> torch.Tensor:
    value = value.to(torch.float32 if isinstance(element, float) and not value.is_floating_point() else value.dtype)
    value = value.clone()
    if value.numel():
        value.view(-1)[where % value.numel()] = element
    return value


# Tensor-level edits (on the dict of torch tensors), then wire-level edits (on the encoded Batch).
tensor_edits = st.one_of(
    st.tuples(st.just("cast"), names, st.sampled_from(TORCH_DTYPES)),
    st.tuples(st.just("element"), names, st.integers(0, 100),
              st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1.0, 2.0, VOCAB, -(2**40), 2**62])),
    st.tuples(st.just("rows"), st.integers(0, 3)),
    st.tuples(st.just("reshape"), names, st.sampled_from([(-1,), (1, -1), (-1, 1, 1)])),
    st.tuples(st.just("drop"), names),
    st.tuples(st.just("zeros"), names, st.lists(st.integers(0, 5), max_size=3)),
)
wire_edits = st.one_of(
    st.tuples(st.just("dtype"), names, st.sampled_from(ALL_WIRE_DTYPES)),
    st.tuples(st.just("shape"), names, st.lists(st.one_of(st.integers(-2, 6), st.sampled_from(HUGE)), max_size=4)),
    st.tuples(st.just("raw"), names, st.binary(max_size=64)),
    st.tuples(st.just("column"), texts, st.lists(texts, max_size=3)),
)


def apply_tensor_edit(tensors: dict[str, torch.Tensor], edit) -> dict[str, torch.Tensor]:
    kind, *args = edit
    tensors = dict(tensors)
    if kind == "rows":
        return {name: value[: args[0]] for name, value in tensors.items()}
    name = args[0]
    if kind == "drop":
        tensors.pop(name, None)
    elif kind == "zeros":
        tensors[name] = torch.zeros(args[1])
    elif name in tensors:
        if kind == "cast":
            tensors[name] = tensors[name].to(args[1])
        elif kind == "element":
            tensors[name] = _set_element(tensors[name], args[1], args[2])
        elif kind == "reshape":
            tensors[name] = tensors[name].reshape(args[1])
    return tensors


def apply_wire_edit(batch: tensor_pb2.Batch, edit) -> None:
    kind, name, value = edit
    if kind == "column":
        batch.columns[name].values.extend(value)
        return
    message = batch.tensors[name]  # a missing name gets an empty Tensor: itself malformed
    if kind == "dtype":
        message.dtype = value
    elif kind == "shape":
        message.ClearField("shape")
        message.shape.extend(value)
    elif kind == "raw":
        message.raw_data = value


@pytest.mark.parametrize("method", TRAINER_METHODS, ids=str)
def test_trainer_batches_structured_garbage(addresses, method):
    good = good_trainer_tensors(method)
    output = {"ComputeLogProbs": "log_probs", "ComputeValues": "values"}.get(method.name)
    seen: set[grpc.StatusCode] = set()

    with grpc.insecure_channel(address_of(addresses, method)) as channel:

        @settings(FUZZ, max_examples=30)
        @given(tensor_steps=st.lists(tensor_edits, max_size=2), wire_steps=st.lists(wire_edits, max_size=2),
               temperature=st.one_of(st.just(1.0), st.floats(width=32)))
        def fuzz(tensor_steps, wire_steps, temperature):
            assume(tensor_steps or wire_steps or math.isnan(temperature) or temperature <= 0)
            tensors = good
            for edit in tensor_steps:
                tensors = apply_tensor_edit(tensors, edit)
            batch = codec.encode_batch(tensors)
            for edit in wire_steps:
                apply_wire_edit(batch, edit)
            request = trainer_request(method, batch, temperature)
            answer = call_raw(channel, method, request.SerializeToString())
            assert_clean(answer, f"{method}(tensor edits {tensor_steps}, wire edits {wire_steps}, T={temperature})")
            seen.add(answer.code)
            if answer.code == grpc.StatusCode.OK and output:
                response = type(request).__name__.replace("Request", "Response")
                module = {"ActorService": actor_pb2, "ReferenceService": reference_pb2, "CriticService": critic_pb2}[
                    method.service.removeprefix("rlfabric.v1.")]
                outputs = getattr(module, response).FromString(answer.responses[0]).outputs
                rows, length = tensors["responses"].shape
                check_output_tensor(outputs, output, (rows, length))
            elif answer.code != grpc.StatusCode.OK:
                assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer.details

        fuzz()
    assert seen == {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
    assert_still_works(addresses, method)


def test_trainer_refuses_sequences_beyond_the_model_positions(addresses):
    """A batch longer than max_position_embeddings is a caller error, and a much longer one would make
    the attention's [S, S] scores exhaust memory."""
    batch = sequence_batch(rows=1, prompt_len=2 * MAX_LEN - 3, response_len=3)
    request = trainer_request(ACTOR_LOG_PROBS, batch)
    with grpc.insecure_channel(addresses["actor"]) as channel:
        answer = call_raw(channel, ACTOR_LOG_PROBS, request.SerializeToString())
    assert answer.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), answer.code
    assert str(MAX_LEN) in answer.details


# --- 5. CoordinatorService.StartRun overrides -------------------------------------------------------------

OVERRIDE_KEYS = ["trainer.total_steps", "data.train_batch_size", "algorithm.gamma", "algorithm.adv_estimator",
                 "rollout.n", "rollout.top_p", "rollout.seed", "weight_sync.timeout_s", "trainer.nope",
                 "trainer.total_steps.deeper", "model.path", "actor.lr", "trainer", "data.", ""]
YAML_GARBAGE = ["[", "{a: [", "'unterminated", "a: b: c", "\x00", "!!python/object/apply:os.system ['true']",
                "*alias", "&anchor [1", ".nan", ".inf", "-1", "1e999", "0", "~", "null", "[1, 2]", "{}", "2"]


def test_start_run_override_garbage(addresses, tmp_path):
    marker = tmp_path / "executed"
    yaml_payloads = [f"!!python/object/apply:os.system ['touch {marker}']",
                     f"!!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path ['{marker}']]"]
    overrides = st.one_of(
        texts,
        st.builds(lambda key, value: f"{key}={value}", st.sampled_from(OVERRIDE_KEYS),
                  st.one_of(st.sampled_from(YAML_GARBAGE + yaml_payloads), texts)),
    )
    with grpc.insecure_channel(addresses["coordinator"]) as channel:

        @settings(FUZZ, max_examples=40)
        @given(overrides=st.lists(overrides, max_size=3))
        def fuzz(overrides):
            answer = call_raw(channel, START_RUN, start_run_request(*overrides).SerializeToString())
            assert_clean(answer, f"StartRun({overrides})", ok_allowed=False)

        fuzz()
        for payload in yaml_payloads:  # not left to chance: each on its own, on an allowed key
            answer = call_raw(channel, START_RUN, start_run_request(f"trainer.total_steps={payload}").SerializeToString())
            assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and "trainer.total_steps" in answer.details
    assert not marker.exists(), "a YAML tag in a StartRun override ran code"
    assert_still_works(addresses, START_RUN)
    status = coordinator_pb2.CoordinatorServiceGetRunStatusResponse.FromString(call_raw(
        grpc.insecure_channel(addresses["coordinator"]), Method(START_RUN.service, "GetRunStatus", "unary"),
        coordinator_pb2.CoordinatorServiceGetRunStatusRequest().SerializeToString()).responses[0])
    assert status.state == coordinator_pb2.RUN_STATE_UNSPECIFIED  # nothing was started


# --- known gaps of the rollout service (fix proposals in the reliability report) --------------------------


@pytest.mark.parametrize("temperature", [math.nan, math.inf])
def test_rollout_refuses_non_finite_temperature(addresses, temperature):
    request = good_generate_request()
    request.sampling_params.temperature = temperature
    with grpc.insecure_channel(addresses["rollout"]) as channel:
        answer = call_raw(channel, GENERATE, request.SerializeToString())
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in answer.details


def test_rollout_refuses_requests_with_too_many_rows(addresses):
    request = good_generate_request(max_tokens=1)
    request.sampling_params.n = 10_000
    with grpc.insecure_channel(addresses["rollout"]) as channel:
        answer = call_raw(channel, GENERATE, request.SerializeToString(), timeout=3)
    assert answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "n" in answer.details
    assert_still_works(addresses, GENERATE)


@pytest.mark.parametrize("announce", ["bucket", "tensor"])
def test_push_weights_refuses_a_manifest_announcing_huge_buckets(addresses, announce):
    """The manifest is checked before anything is allocated: a bucket larger than its tensors, or a
    tensor the model does not have (or of another shape), however large, is refused at once."""
    manifest, chunk = push_weights_payload(name="model.embed_tokens.weight")
    message = rollout_pb2.RolloutServicePushWeightsRequest.FromString(manifest)
    message.manifest.buckets[0].num_bytes = 2**45  # 32 TiB
    if announce == "tensor":  # a real weight's name, announced as 32 TiB of bytes
        message.manifest.buckets[0].tensors[0].shape[:] = [2**45]
    with grpc.insecure_channel(addresses["rollout"]) as channel:
        answer = call_raw(channel, PUSH_WEIGHTS, [message.SerializeToString(), chunk], timeout=10)
    assert answer.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), answer
    assert ("announces 35184372088832 bytes" if announce == "bucket" else "shape (35184372088832,)") in answer.details
    assert_still_works(addresses, PUSH_WEIGHTS)
