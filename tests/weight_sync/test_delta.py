"""Delta weight sync (weight_sync.delta): actor -> 2 bfloat16 hf replicas over gloo and grpc, real services on
loopback, the coordinator's plane driving. After a chain of deltas the replicas' weights are bit for bit what a
full sync gives them; a corrupted delta or a replica that lost its base gets the full weights (counted) and ends
exact all the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zstandard

from rlfabric.core.errors import InvalidArgument
from rlfabric.weight_sync import delta as delta_module
from rlfabric.weight_sync.delta import DeltaBase, DeltaRejected, apply_tensor, encode_tensor

from .helpers import Mesh, mesh_config

CHAIN = 50  # delta syncs in a row (the target)
LR = 1e-6  # each step an Adam step at an RL learning rate: few bfloat16 elements change


def bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).view(torch.int16)


@pytest.mark.parametrize("encodings", [("sparse",), ("xor_zstd",), ("sparse", "xor_zstd")])
@pytest.mark.parametrize("lr", [1e-6, 1e-3, 1.0])
def test_every_encoding_rebuilds_the_new_bits_exactly(encodings, lr):
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(20_000, generator=generator) * 0.02
    base = bits(weights)
    new = bits(weights + torch.randn(20_000, generator=generator).sign() * lr)
    encoding, blob = encode_tensor(new, base, zstandard.ZstdCompressor(), encodings)
    rebuilt = base.clone()
    apply_tensor(rebuilt, encoding, memoryview(blob), zstandard.ZstdDecompressor())
    assert torch.equal(rebuilt, new)
    assert encoding in (*encodings, "raw") and len(blob) <= new.numel() * 2  # never more than the tensor itself


@pytest.mark.parametrize("changed", [[0], [999], [3, 500], list(range(0, 1000, 7))])
def test_the_changed_elements_anywhere_in_any_number(changed):
    base = bits(torch.linspace(-1, 1, 1000))
    new = base.clone()
    new[changed] += 1
    encoding, blob = encode_tensor(new, base, zstandard.ZstdCompressor(), ("sparse",))
    rebuilt = base.clone()
    apply_tensor(rebuilt, encoding, memoryview(blob), zstandard.ZstdDecompressor())
    assert encoding == "sparse" and torch.equal(rebuilt, new)


def test_nothing_changed_is_no_bytes_and_bad_bytes_are_rejected():
    base = bits(torch.linspace(-1, 1, 1000))
    assert encode_tensor(base, base.clone(), zstandard.ZstdCompressor()) == ("unchanged", b"")
    new = base.clone()
    new[[3, 500]] += 1
    encoding, blob = encode_tensor(new, base, zstandard.ZstdCompressor(), ("sparse",))
    with pytest.raises(DeltaRejected, match="does not decode"):
        apply_tensor(base.clone(), encoding, memoryview(blob[:-3]), zstandard.ZstdDecompressor())
    with pytest.raises(DeltaRejected, match="does not decode"):
        apply_tensor(base.clone(), "raw", memoryview(b"\0" * 10), zstandard.ZstdDecompressor())


def test_a_delta_against_another_base_is_rejected():
    base = DeltaBase()
    assert isinstance(DeltaRejected("x"), InvalidArgument)  # the group stays in step: every byte arrived
    with pytest.raises(DeltaRejected, match="holds no base"):
        base.apply(_delta_manifest(base_version=3), [])


def _delta_manifest(base_version: int):
    from rlfabric.weight_sync.buckets import plan_buckets
    from rlfabric.weight_sync.manifest import DeltaSpec, Manifest, TensorDelta

    layout = tuple(plan_buckets({"w": torch.zeros(4, dtype=torch.bfloat16)}, 1 << 20))
    return Manifest(4, "g", (), keep_base=True, delta=DeltaSpec(base_version, layout, (TensorDelta("w", "unchanged", 0),)))


# -- through the services ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gloo", "grpc"])
def mesh(request, tiny_model):
    config = mesh_config(tiny_model, f"weight_sync.transport={request.param}", "weight_sync.delta=true",
                         "rollout.dtype=bfloat16", f"actor.lr={LR}")
    mesh = Mesh(config, {"r0": config, "r1": config})
    plane = mesh.open_plane()
    yield mesh, plane
    mesh.run(plane.close())
    mesh.stop()


def served(mesh: Mesh, replica: str) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in mesh.rollouts[replica].server.service.engine._base_weights().items()}


def test_weights_after_a_chain_of_deltas_are_a_full_syncs_bit_for_bit(mesh):
    mesh, plane = mesh
    first = mesh.run(plane.sync(1))
    assert first.ok and not first.delta and first.num_bytes == first.full_bytes  # nothing kept yet: full
    ratios = []
    for version in range(2, CHAIN + 2):
        mesh.train_step(seed=version)
        report = mesh.run(plane.sync(version))
        assert report.ok and report.delta and report.fallback_full == 0, report.failed
        ratios.append(report.num_bytes / report.full_bytes)
    assert all(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)
    after_deltas = served(mesh, "r0")
    full = mesh.run(plane.sync(CHAIN + 1, full=True))  # the same version, all of it
    assert full.ok and not full.delta and full.fallback_full == 0
    after_full = served(mesh, "r0")
    assert after_full.keys() == after_deltas.keys()
    assert all(torch.equal(after_full[name].view(torch.int16), after_deltas[name].view(torch.int16))
               for name in after_full)
    # Few bfloat16 elements move at this learning rate, so a delta is a small part of the weights.
    assert max(ratios) < 0.5, ratios


def test_a_corrupted_delta_gets_the_full_weights_and_ends_exact(mesh, monkeypatch):
    mesh, plane = mesh
    mesh.run(plane.sync(100, full=True))
    mesh.train_step(seed=101)
    encode = delta_module.encode_tensor

    def corrupt(new, base, compressor, encodings=("sparse", "xor_zstd")):
        encoding, blob = encode(new, base, compressor, encodings)
        if encoding == "raw":  # one bit flipped in the applied bytes: the tensor's CRC-32 no longer matches
            blob = bytes([blob[0] ^ 1]) + blob[1:]
        elif encoding != "unchanged":
            encoding, blob = "raw", bytes(new.view(torch.uint8).numpy() ^ 1)
        return encoding, blob

    monkeypatch.setattr(delta_module, "encode_tensor", corrupt)
    report = mesh.run(plane.sync(101))
    monkeypatch.undo()
    assert report.ok, report.failed
    assert report.fallback_full == 2 and report.num_bytes > report.full_bytes  # the delta, then the full weights
    assert all(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)
    mesh.train_step(seed=102)
    again = mesh.run(plane.sync(102))  # the full sync left every base in step: deltas again
    assert again.ok and again.delta and again.fallback_full == 0
    assert all(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)


def test_a_replica_that_lost_its_base_gets_the_full_weights(mesh):
    mesh, plane = mesh
    mesh.run(plane.sync(200, full=True))
    mesh.train_step(seed=201)
    _lose_base(mesh, "r1", plane.group.transport)  # as after a restart of its receiver
    report = mesh.run(plane.sync(201))
    assert report.ok and report.fallback_full == 1, report.failed  # rejected by r1, which then got the full weights
    assert all(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)
    # The plane's record says a member holds another version: over grpc a peer that holds the version last sent
    # brings it back in step first and the sync stays a delta; otherwise the actor sends the full weights at once.
    mesh.train_step(seed=202)
    plane.held["r0"] = 7
    report = mesh.run(plane.sync(202))
    if plane.group.transport == "grpc":
        assert report.ok and report.delta and (report.catchup_from_peer, report.fallback_full) == (1, 0)
    else:
        assert report.ok and not report.delta and report.fallback_full == 1
    assert all(mesh.serves_the_actors_weights(name) for name in mesh.rollouts)


def _lose_base(mesh: Mesh, replica: str, transport: str) -> None:
    service = mesh.rollouts[replica].server.service
    servicer = service.bindings[0].servicer
    base = servicer._pushes.base if transport == "grpc" else service.engine.weight_sync._receiver.base
    base.clear()


def test_a_manifest_whose_delta_names_other_tensors_is_refused():
    from rlfabric.weight_sync.manifest import Manifest

    manifest = _delta_manifest(base_version=3)
    message = manifest.to_proto()
    message.delta.tensors[0].name = "other"
    with pytest.raises(InvalidArgument, match="layout's, in layout order"):
        Manifest.from_proto(message)
    assert Manifest.from_proto(manifest.to_proto()) == dataclasses.replace(manifest)


def test_a_delta_entry_larger_than_its_tensor_or_for_an_unchanged_one_is_refused():
    from rlfabric.weight_sync.manifest import Manifest, TensorDelta, WeightLimits

    base = _delta_manifest(base_version=3)
    changed = dataclasses.replace(base, delta=dataclasses.replace(base.delta, tensors=(TensorDelta("w", "raw", 0),)))
    message = changed.to_proto()
    bucket = message.buckets.add(index=0, num_bytes=64)
    bucket.tensors.add(name="w", dtype=message.delta.layout[0].tensors[0].dtype, shape=[9], offset=0)
    with pytest.raises(InvalidArgument, match="not uint8 bytes of at most"):
        Manifest.from_proto(message)  # bfloat16, not uint8
    message = changed.to_proto()
    message.buckets.add(index=0, num_bytes=64).tensors.add(name="w", dtype=_uint8_wire(), shape=[9], offset=0)
    with pytest.raises(InvalidArgument, match="not uint8 bytes of at most"):
        Manifest.from_proto(message)  # 9 bytes for a tensor of 8
    unchanged = base.to_proto()  # an entry for a tensor the delta says is unchanged
    unchanged.buckets.add(index=0, num_bytes=64).tensors.add(name="w", dtype=_uint8_wire(), shape=[8], offset=0)
    with pytest.raises(InvalidArgument, match="exactly once"):
        Manifest.from_proto(unchanged)
    # The layout is what a receiver's limits judge: its tensors, its bytes.
    limits = WeightLimits.of({"w": torch.zeros(4, dtype=torch.bfloat16)})
    limits.check(base)
    with pytest.raises(InvalidArgument, match="has no weight of that name"):
        WeightLimits.of({"v": torch.zeros(4)}).check(base)


def _uint8_wire() -> int:
    from rlfabric.core import codec

    return codec.wire_dtype(torch.uint8)
