"""Calls a mesh's services with whichever `rlfabric.v1` stubs come first on sys.path: tests/core/test_proto_wire.py
runs it with stubs generated from the protos before their messages were renamed (against today's servers) and
with today's stubs (against servers of then). It names no message: each request is the class its stub's method
descriptor names, filled from a dict of field names (which the renames kept), so the same calls run on either
stubs. Run as a script (only the stubs are imported):

    python tests/core/wire_calls.py '{"addresses": {"reward": "127.0.0.1:5"}, "work_dir": "/tmp/w"}'

prints {"types": {service: [[request type, response type], ...]}, "results": {role: {...}}} as JSON.
"""

from __future__ import annotations

import base64
import importlib
import json
import struct
import sys

import grpc
from google.protobuf import json_format

TIMEOUT_S = 300
FILE_OF_SERVICE = {"ActorService": "actor", "ReferenceService": "reference", "CriticService": "critic",
                   "RolloutService": "rollout", "RewardService": "reward", "EnvironmentService": "environment",
                   "CoordinatorService": "coordinator"}
# A batch in the actor's layout: one mini-batch of the test mesh (8 prompts x 4 samples), prompt 4 tokens and
# response 4 (token ids below the tiny model's 100).
ROWS, PROMPT, RESPONSE = 32, 4, 4


class Stubs:
    """The stubs of one mesh: call(service, rpc, **fields) -> the answer as a dict (field names as in the proto)."""

    def __init__(self, addresses: dict[str, str]):
        self.channels = {role: grpc.insecure_channel(address) for role, address in addresses.items()}
        self.types: dict[str, list[list[str]]] = {}

    def _method(self, role: str, service: str, rpc: str):
        module = importlib.import_module(f"rlfabric.v1.{FILE_OF_SERVICE[service]}_pb2")
        method = module.DESCRIPTOR.services_by_name[service].methods_by_name[rpc]
        stub = getattr(importlib.import_module(f"rlfabric.v1.{FILE_OF_SERVICE[service]}_pb2_grpc"), f"{service}Stub")
        pair = [method.input_type.name, method.output_type.name]
        if pair not in self.types.setdefault(service, []):
            self.types[service].append(pair)
        return getattr(module, method.input_type.name), getattr(stub(self.channels[role]), rpc), method

    def request(self, role: str, service: str, rpc: str, fields: dict):
        request_class, call, method = self._method(role, service, rpc)
        return json_format.ParseDict(fields, request_class()), call, method

    def call(self, role: str, service: str, rpc: str, **fields) -> dict | list[dict]:
        request, call, method = self.request(role, service, rpc, fields)
        answer = call(request, timeout=TIMEOUT_S, wait_for_ready=True)
        return [as_dict(a) for a in answer] if method.server_streaming else as_dict(answer)

    def start(self, role: str, service: str, rpc: str, **fields) -> grpc.Future:
        """The call as a future, for calls that must run together (a weight sync's joins, sends and receives)."""
        request, call, _ = self.request(role, service, rpc, fields)
        return call.future(request, timeout=TIMEOUT_S, wait_for_ready=True)


def as_dict(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def tensor(dtype: str, shape: list[int], values: list, code: str) -> dict:
    """A Tensor message as a dict: little-endian raw bytes (json_format takes bytes as base64)."""
    raw = struct.pack(f"<{len(values)}{code}", *values)
    return {"dtype": dtype, "shape": shape, "raw_data": base64.b64encode(raw).decode()}


def batch(**extra: dict) -> dict:
    """input_ids, attention_mask, responses, response_mask for ROWS rows, plus `extra` tensors."""
    ids = [(row * 7 + column * 3) % 90 + 5 for row in range(ROWS) for column in range(PROMPT + RESPONSE)]
    responses = [ids[row * (PROMPT + RESPONSE) + PROMPT + c] for row in range(ROWS) for c in range(RESPONSE)]
    tensors = {"input_ids": tensor("DATA_TYPE_INT64", [ROWS, PROMPT + RESPONSE], ids, "q"),
               "attention_mask": tensor("DATA_TYPE_INT64", [ROWS, PROMPT + RESPONSE], [1] * len(ids), "q"),
               "responses": tensor("DATA_TYPE_INT64", [ROWS, RESPONSE], responses, "q"),
               "response_mask": tensor("DATA_TYPE_INT64", [ROWS, RESPONSE], [1] * len(responses), "q")}
    return {"tensors": {**tensors, **extra}}


def per_token(values: list[float]) -> dict:
    return tensor("DATA_TYPE_FLOAT32", [ROWS, RESPONSE], values, "f")


def coordinator(stubs: Stubs, work_dir: str) -> dict:
    """A run: started, paused and resumed, a checkpoint at its first step boundary, stopped, its metrics."""
    c = "coordinator", "CoordinatorService"
    before = stubs.call(*c, "GetRunStatus")
    started = stubs.call(*c, "StartRun", overrides=["trainer.total_steps=4"])
    stubs.call(*c, "PauseRun")
    stubs.call(*c, "ResumeRun")
    checkpoint = stubs.call(*c, "SaveCheckpoint")
    stubs.call(*c, "StopRun", skip_checkpoint=True)
    metrics = stubs.call(*c, "StreamMetrics", from_step=1)
    return {"before": before, "started": started, "checkpoint": checkpoint, "metrics": metrics,
            "after": stubs.call(*c, "GetRunStatus")}


def weight_sync(stubs: Stubs, version: int) -> dict:
    """A gloo sync from the actor to the rollout and the reference, every step an RPC of this client."""
    group = stubs.call("actor", "ActorService", "OpenWeightSyncGroup", transport="WEIGHT_TRANSPORT_GLOO",
                       num_receivers=2, timeout_s=60)["group"]
    joins = [stubs.start("rollout", "RolloutService", "JoinWeightSyncGroup", group=group, rank=1),
             stubs.start("reference", "ReferenceService", "JoinWeightSyncGroup", group=group, rank=2)]
    for join in joins:
        join.result()
    manifest = stubs.call("actor", "ActorService", "PrepareWeightSync", group_id=group["group_id"],
                          version=version)["manifest"]
    receives = [stubs.start("rollout", "RolloutService", "ReceiveWeights", manifest=manifest),
                stubs.start("reference", "ReferenceService", "ReceiveWeights", manifest=manifest)]
    sent = stubs.call("actor", "ActorService", "BroadcastWeights", group_id=group["group_id"], version=version)
    received = [as_dict(receive.result()) for receive in receives]
    stubs.call("actor", "ActorService", "CloseWeightSyncGroup", group_id=group["group_id"])
    return {"sent": sent, "rollout": received[0], "reference": received[1]}


def model_roles(stubs: Stubs, work_dir: str) -> dict:
    """Actor, reference and critic: log-probs, values, updates, checkpoints, an export, a weight sync."""
    a, r, c = ("actor", "ActorService"), ("reference", "ReferenceService"), ("critic", "CriticService")
    update = batch(advantages=per_token([0.5, -0.5, 1.0, 0.0] * ROWS),
                   ref_log_probs=per_token([-2.0] * ROWS * RESPONSE))  # the mesh's actor has the KL loss on
    results = {
        "actor_log_probs": stubs.call(*a, "ComputeLogProbs", input={"batch": batch(), "temperature": 1.0}),
        "reference_log_probs": stubs.call(*r, "ComputeLogProbs", input={"batch": batch()}),
        "actor_update": stubs.call(*a, "UpdatePolicy", batch=update, global_step=1),
        "actor_saved": stubs.call(*a, "SaveCheckpoint", location={"path": f"{work_dir}/actor"}),
        "actor_loaded": stubs.call(*a, "LoadCheckpoint", location={"path": f"{work_dir}/actor"}),
        "actor_exported": stubs.call(*a, "ExportHF", path=f"{work_dir}/export"),
        "values": stubs.call(*c, "ComputeValues", batch=batch()),
        "critic_update": stubs.call(*c, "UpdateValues", global_step=1, batch=batch(
            values=per_token([0.0] * ROWS * RESPONSE), returns=per_token([1.0] * ROWS * RESPONSE))),
        "critic_saved": stubs.call(*c, "SaveCheckpoint", location={"path": f"{work_dir}/critic"}),
        "critic_loaded": stubs.call(*c, "LoadCheckpoint", location={"path": f"{work_dir}/critic"}),
        "actor_status": stubs.call(*a, "GetStatus"),
        "critic_status": stubs.call(*c, "GetStatus"),
    }
    version = int(stubs.call("rollout", "RolloutService", "GetStatus").get("weight_version", 0)) + 1
    results["sync"] = weight_sync(stubs, version)
    results["reference_status"] = stubs.call(*r, "GetStatus")
    return results


def rollout(stubs: Stubs, work_dir: str) -> dict:
    """Generation (whole and streamed) and the replica's controls."""
    s = "rollout", "RolloutService"
    request = {"prompts": [{"token_ids": [5, 6, 7]}], "sampling_params": {"n": 2, "max_tokens": 4, "seed": 1,
                                                                            "logprobs": True}}
    return {"generated": stubs.call(*s, "Generate", **request),
            "streamed": stubs.call(*s, "GenerateStream", **request),
            "paused": stubs.call(*s, "Pause", abort=False), "resumed": stubs.call(*s, "Resume"),
            "slept": stubs.call(*s, "Sleep", level=1), "woke": stubs.call(*s, "WakeUp"),
            "status": stubs.call(*s, "GetStatus")}


def reward(stubs: Stubs, work_dir: str) -> dict:
    """Two GSM8K answers, one right, with the conversation as chat messages (ChatMessage, now in common.proto)."""
    conversation = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "What is 6*7?"}]
    items = [{"data_source": "openai/gsm8k", "prompt": "What is 6*7?", "response": f"#### {answer}",
              "ground_truth": "42", "prompt_messages": conversation} for answer in (42, 41)]
    return {"scored": stubs.call("reward", "RewardService", "Score", items=items),
            "status": stubs.call("reward", "RewardService", "GetStatus")}


def environment(stubs: Stubs, work_dir: str) -> dict:
    """A calculator session: a tool call, then the final answer."""
    e = "env", "EnvironmentService"
    session = stubs.call(*e, "Reset", task={"environment": "calculator", "prompt": "What is 6*7?",
                                            "ground_truth": "42"})
    call = {"name": "calculator", "arguments_json": json.dumps({"expression": "6*7"})}
    tool = stubs.call(*e, "Step", session_id=session["session_id"], action={"text": "6*7?", "tool_calls": [call]})
    final = stubs.call(*e, "Step", session_id=session["session_id"], action={"text": "#### 42"})
    closed = stubs.call(*e, "Close", session_id=session["session_id"])
    return {"reset": session, "tool": tool, "final": final, "closed": closed, "status": stubs.call(*e, "GetStatus")}


# In this order: the run first (a fresh run needs untrained trainers), then what changes their weights.
SCENARIOS = {"coordinator": coordinator, "model_roles": model_roles, "rollout": rollout, "reward": reward,
             "environment": environment}


def main(spec: dict) -> dict:
    stubs = Stubs(spec["addresses"])
    results = {name: scenario(stubs, spec["work_dir"]) for name, scenario in SCENARIOS.items()
               if name in spec["scenarios"]}
    return {"types": stubs.types, "results": results}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
