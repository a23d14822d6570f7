"""Adapter-only weight sync (actor.lora, weight_sync.lora adapter): the actor sends its LoRA adapters alone
and the hf rollout engine applies them on its base model through peft. Real services on loopback over
gloo and grpc: after a sync the rollout's sampled log-probs equal the actor's, the bytes moved are the
adapter's (a fraction of the model's), and a bad adapter manifest is INVALID_ARGUMENT while the old
version keeps serving. The manifest checks themselves (WeightLimits.check_adapter) are tested without
services at the end."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlfabric.core import codec
from rlfabric.core.config import ConfigError
from rlfabric.core.errors import InvalidArgument, ResourceExhausted
from rlfabric.v1 import weight_sync_pb2
from rlfabric.weight_sync.buckets import pack
from rlfabric.weight_sync.grpc_stream import push_weights, serialize_chunks
from rlfabric.weight_sync.manifest import AdapterSpec, Manifest, WeightLimits, adapter_tensor_name, aligned
from tests.numerics import ENGINE_LOGPROB_GAP
from tests.rollout.helpers import original_weights

from .helpers import Mesh, mesh_config
from .test_sync_services import _samples, rollout_version

pytestmark = pytest.mark.slow

RANK, ALPHA = 8, 16.0
LORA = [f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}"]


def adapter_shapes(model_path, rank: int = RANK) -> dict[str, tuple[int, int]]:
    """The wire names and shapes of an all-linear rank-`rank` adapter of the model at model_path."""
    shapes = {}
    for name, tensor in original_weights(model_path).items():
        module = name.removesuffix(".weight")
        if tensor.dim() == 2 and AdapterSpec.of(rank, ALPHA, "all-linear").targets(module):
            out_features, in_features = tensor.shape
            shapes[adapter_tensor_name(module, "A")] = (rank, in_features)
            shapes[adapter_tensor_name(module, "B")] = (out_features, rank)
    return shapes


def float32_bytes(shapes) -> int:
    return sum(aligned(math.prod(shape) * 4) for shape in shapes)


@pytest.fixture(scope="module", params=["gloo", "grpc"])
def mesh(request, tiny_model):
    config = mesh_config(tiny_model, f"weight_sync.transport={request.param}", *LORA)
    assert config.syncs_lora_adapters()  # weight_sync.lora auto with the hf engine
    mesh = Mesh(config, {"r0": config})
    plane = mesh.open_plane()
    yield mesh, plane
    mesh.run(plane.close())
    mesh.stop()


@pytest.mark.numerics
def test_an_adapter_sync_makes_the_replica_serve_the_actors_policy(mesh, tiny_model):
    mesh, plane = mesh
    address = mesh.addresses["r0"]
    model_bytes = float32_bytes(t.shape for t in original_weights(tiny_model).values())
    for version, seed in ((1, 21), (2, 22)):
        mesh.train_step(seed)
        assert mesh.logprob_gap(address) > 10 * ENGINE_LOGPROB_GAP  # stale before the sync
        report = mesh.run(plane.sync(version))
        assert report.ok, report.failed
        assert report.num_bytes == float32_bytes(adapter_shapes(tiny_model).values())  # the adapter, nothing else
        assert report.num_bytes < model_bytes / 4
        assert rollout_version(address) == version
        assert mesh.logprob_gap(address) <= ENGINE_LOGPROB_GAP


def test_a_bad_adapter_manifest_is_invalid_argument_and_the_old_version_keeps_serving(mesh, tiny_model):
    mesh, plane = mesh
    address = mesh.addresses["r0"]
    assert mesh.run(plane.sync(5)).ok
    before = _samples(address)
    shapes = adapter_shapes(tiny_model)
    adapter = AdapterSpec.of(RANK, ALPHA, "all-linear")
    wrong_shape = {name: torch.zeros(shape[0] + 1, shape[1]) if i == 0 else torch.zeros(shape)
                   for i, (name, shape) in enumerate(shapes.items())}
    other_rank = {name: torch.zeros(4 if s[0] == RANK else s[0], 4 if s[1] == RANK else s[1])
                  for name, s in shapes.items()}
    cases = [(wrong_shape, adapter, "shape"),
             (other_rank, AdapterSpec.of(4, ALPHA, "all-linear"), "serves AdapterSpec(rank=8"),
             ({"model.norm.weight": torch.zeros(64)}, adapter, "not a LoRA adapter weight")]
    for tensors, spec, message in cases:
        manifest, buffers = pack(tensors, 1 << 20, version=6, group_id=plane.group.group_id)
        manifest = dataclasses.replace(manifest, adapter=spec)
        result = mesh.run(push_weights(address, serialize_chunks(manifest, buffers), timeout_s=10))
        assert result.error.startswith("INVALID_ARGUMENT") and message in result.error, result.error
    assert rollout_version(address) == 5 and _samples(address) == before
    assert mesh.run(plane.sync(7)).ok and rollout_version(address) == 7  # the plane still syncs


def test_full_weights_still_load_into_a_replica_serving_adapters(mesh, tiny_model):
    """A merged (or checkpoint) load goes into the base layers under the base model's names."""
    mesh, plane = mesh
    address = mesh.addresses["r0"]
    weights = original_weights(tiny_model)
    manifest, buffers = pack(weights, 1 << 20, version=8, group_id=plane.group.group_id)
    result = mesh.run(push_weights(address, serialize_chunks(manifest, buffers), timeout_s=10))
    assert not result.error and rollout_version(address) == 8


# -- the checks, without services -------------------------------------------------------------------

def _limits(tiny_model, adapter: AdapterSpec | None) -> WeightLimits:
    return dataclasses.replace(WeightLimits.from_checkpoint(str(tiny_model)), adapter=adapter)


def _manifest(tensors: dict[str, torch.Tensor], adapter: AdapterSpec) -> Manifest:
    manifest, _ = pack(tensors, 1 << 20, version=1, group_id="g")
    return dataclasses.replace(manifest, adapter=adapter)


def test_adapter_manifests_are_checked_against_the_base_model_before_anything_is_allocated(tiny_model):
    adapter = AdapterSpec.of(RANK, ALPHA, ["q_proj", "v_proj"])
    limits = _limits(tiny_model, adapter)
    shapes = {n: s for n, s in adapter_shapes(tiny_model).items() if ".q_proj." in n or ".v_proj." in n}
    good = {name: torch.zeros(shape) for name, shape in shapes.items()}
    limits.check(_manifest(good, adapter))  # fits
    q_a = next(n for n in shapes if ".q_proj.lora_A" in n)
    k_a = q_a.replace("q_proj", "k_proj")
    bad = {
        "not targeted": ({**good, k_a: torch.zeros(RANK, 64), k_a.replace("lora_A", "lora_B"): torch.zeros(64, RANK)},
                         "not among the adapter's target_modules"),
        "one half": ({n: t for n, t in good.items() if n != q_a}, "only one of lora_A and lora_B"),
        "no such layer": ({**good, adapter_tensor_name("model.layers.9.self_attn.q_proj", "A"): torch.zeros(RANK, 64)},
                          "no 2-D layer weight"),
        "integer": ({**good, q_a: torch.zeros(RANK, 64, dtype=torch.int32)}, "not floating point"),
    }
    for case, (tensors, message) in bad.items():
        with pytest.raises(InvalidArgument, match=message):
            limits.check(_manifest(tensors, adapter))
        assert case
    too_big = AdapterSpec.of(65, ALPHA, ["q_proj"])  # q_proj is 64 x 64
    with pytest.raises(InvalidArgument, match="exceeds layer"):
        _limits(tiny_model, too_big).check(_manifest({q_a: torch.zeros(65, 64)}, too_big))
    with pytest.raises(InvalidArgument, match="served without adapters"):
        _limits(tiny_model, None).check(_manifest(good, adapter))
    padded = _manifest(good, adapter)  # a bucket may not announce more than its tensors; the total is bounded too
    huge = dataclasses.replace(padded, buckets=padded.buckets * 1000)
    with pytest.raises(ResourceExhausted, match="takes at most"):
        limits.check(huge)


def test_the_adapter_settings_travel_in_the_manifest_and_are_checked_on_arrival():
    manifest = Manifest(3, "g", adapter=AdapterSpec.of(8, 16, "all-linear"))
    message = manifest.to_proto()
    assert message.lora_adapter.rank == 8 and list(message.lora_adapter.target_modules) == ["all-linear"]
    assert not Manifest(3, "g").to_proto().HasField("lora_adapter")  # full weights: the wire as before
    message.buckets.add(index=0, num_bytes=64, tensors=[weight_sync_pb2.WeightTensorSpec(
        name="x", shape=[16], dtype=codec.wire_dtype(torch.float32))])
    assert Manifest.from_proto(message).adapter == AdapterSpec(8, 16.0, ("all-linear",))
    message.lora_adapter.rank = 0
    with pytest.raises(InvalidArgument, match="rank 0 must be > 0"):
        Manifest.from_proto(message)


def test_weight_sync_lora_resolves_per_engine_and_adapter_with_sglang_is_refused_naming_the_key(tiny_model):
    assert mesh_config(tiny_model, *LORA).syncs_lora_adapters()
    assert mesh_config(tiny_model, *LORA, "rollout.engine=vllm").syncs_lora_adapters()
    assert not mesh_config(tiny_model, *LORA, "rollout.engine=sglang").syncs_lora_adapters()  # auto -> merged
    assert not mesh_config(tiny_model, *LORA, "weight_sync.lora=merged").syncs_lora_adapters()
    assert not mesh_config(tiny_model).syncs_lora_adapters()  # no LoRA: full weights
    with pytest.raises(ConfigError, match="weight_sync.lora: adapter .* rollout.engine sglang"):
        mesh_config(tiny_model, *LORA, "rollout.engine=sglang", "weight_sync.lora=adapter")


def test_vllm_gets_the_smallest_lora_rank_it_accepts_and_a_rank_above_its_largest_is_refused_naming_the_key(tiny_model):
    """vLLM's max_lora_rank takes fixed values: the actor's rank rounded up to one; above 512 the vLLM
    replica stops at start naming actor.lora.rank (no vLLM needed to check the settings)."""
    from rlfabric.rollout.vllm_engine import VLLMEngine

    settings = VLLMEngine(mesh_config(tiny_model, "actor.lora.rank=12", "rollout.engine=vllm"))._lora_args()
    assert settings["enable_lora"] and settings["max_lora_rank"] == 16 and settings["max_loras"] == 2
    assert VLLMEngine(mesh_config(tiny_model, "actor.lora.rank=12", "rollout.engine=vllm",
                                  "weight_sync.lora=merged"))._lora_args() == {}  # full weights: no LoRA in vLLM
    with pytest.raises(ValueError, match="actor.lora.rank 600 is above vLLM's largest LoRA rank 512"):
        VLLMEngine(mesh_config(tiny_model, "actor.lora.rank=600", "rollout.engine=vllm"))._lora_args()
