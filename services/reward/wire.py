"""Conversions between the reward domain objects (ScoreItem, ItemResult) and rlfabric.v1 messages,
shared by the servicer (proto -> domain -> proto) and the client (domain -> proto -> domain).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from rlfabric.core.errors import InvalidArgument
from rlfabric.reward.items import (
    STATUS_CRASHED,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    ItemResult,
    ScoreItem,
    json_default,
)
from rlfabric.v1 import reward_pb2

STATUS_TO_PROTO = {
    STATUS_OK: reward_pb2.SCORE_STATUS_OK,
    STATUS_ERROR: reward_pb2.SCORE_STATUS_ERROR,
    STATUS_TIMEOUT: reward_pb2.SCORE_STATUS_TIMEOUT,
    STATUS_CRASHED: reward_pb2.SCORE_STATUS_CRASHED,
}
STATUS_FROM_PROTO = {value: key for key, value in STATUS_TO_PROTO.items()}


# --- server side: request -> domain, domain -> response ---


def items_from_request(request: reward_pb2.RewardServiceScoreRequest) -> list[ScoreItem]:
    """Domain items of a RewardServiceScoreRequest; InvalidArgument names the first item whose extra_info_json
    is bad."""
    return [_item_from_proto(index, item) for index, item in enumerate(request.items)]


def _item_from_proto(index: int, item: reward_pb2.ScoreItem) -> ScoreItem:
    extra_info = None
    if item.extra_info_json:
        try:
            extra_info = json.loads(item.extra_info_json)
        except json.JSONDecodeError as error:
            raise InvalidArgument(f"item {index}: extra_info_json is not valid JSON: {error}") from None
        if not isinstance(extra_info, dict):
            raise InvalidArgument(
                f"item {index}: extra_info_json must be a JSON object, got a {type(extra_info).__name__}"
            )
    return ScoreItem(
        data_source=item.data_source,
        response=item.response,
        ground_truth=item.ground_truth,
        extra_info=extra_info,
        prompt=item.prompt,
        response_length=item.response_length,
        response_token_ids=list(item.response_token_ids) if item.response_token_ids else (),
        prompt_messages=[{"role": turn.role, "content": turn.content} for turn in item.prompt_messages],
    )


def response_from_results(results: Sequence[ItemResult]) -> reward_pb2.RewardServiceScoreResponse:
    response = reward_pb2.RewardServiceScoreResponse()
    add = response.results.add  # built in place: a list passed to the constructor would be copied
    for result in results:
        message = add(score=result.score, status=STATUS_TO_PROTO[result.status])
        # Fields at their default are left unset: the same bytes, and much faster per item.
        if result.message:
            message.message = result.message
        if result.metrics:
            message.metrics.update(result.metrics)
    return response


# --- client side: domain -> request, response -> domain ---


def request_from_items(items: Sequence[ScoreItem]) -> reward_pb2.RewardServiceScoreRequest:
    """The RewardServiceScoreRequest of a batch; InvalidArgument names the first item that cannot go on the wire."""
    request = reward_pb2.RewardServiceScoreRequest()
    add = request.items.add  # built in place: a list passed to the constructor would be copied
    for index, item in enumerate(items):
        if not isinstance(item.ground_truth, str):
            raise InvalidArgument(
                f"item {index}: ground_truth must be a string on the wire, got a "
                f"{type(item.ground_truth).__name__} (convert it, e.g. with json.dumps, and parse it in your scorer)"
            )
        message = add(data_source=item.data_source, response=item.response, ground_truth=item.ground_truth)
        # Fields at their default are left unset: the same bytes, and much faster per item.
        if item.extra_info:
            try:
                message.extra_info_json = json.dumps(item.extra_info, default=json_default)
            except (TypeError, ValueError) as error:
                raise InvalidArgument(f"item {index}: extra_info is not JSON-serialisable: {error}") from None
        if item.prompt:
            message.prompt = item.prompt
        for turn_index, turn in enumerate(item.prompt_messages):
            try:
                message.prompt_messages.add(role=turn["role"], content=turn["content"])
            except (KeyError, TypeError, ValueError) as error:  # ValueError: protobuf's wrong-type error
                raise InvalidArgument(
                    f"item {index}: prompt_messages[{turn_index}] must be a dict with string role and content "
                    f"({type(error).__name__}: {error})"
                ) from None
        if len(item.response_token_ids):
            message.response_token_ids.extend(item.response_token_ids)
        if item.response_length:
            message.response_length = item.response_length
    return request


def results_from_response(response: reward_pb2.RewardServiceScoreResponse) -> list[ItemResult]:
    return [_result_from_proto(result) for result in response.results]


def _result_from_proto(result: reward_pb2.ScoreResult) -> ItemResult:
    return ItemResult(
        score=result.score,
        status=STATUS_FROM_PROTO.get(result.status, STATUS_ERROR),
        message=result.message,
        metrics=dict(result.metrics) if result.metrics else {},
    )

