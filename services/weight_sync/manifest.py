"""What a weight sync sends, as plain dataclasses: the group's rendezvous info and the manifest of
flattened buckets. Conversion to and from the rlfabric.v1 messages lives here too, with the checks
a receiver runs on a manifest it did not build (InvalidArgument naming what is wrong), and
WeightLimits: the receiver's own weights, which every manifest is checked against before a single
bucket is allocated (a manifest decides how much memory the receiver maps).

A manifest either carries full weights (the model's own names) or, with `adapter` set, LoRA adapters
alone (weight_sync.lora): peft's names (adapter_tensor_name) and the settings the receiver applies
them with. WeightLimits checks an adapter against the base model's layers as it checks full weights.

The checksum of a bucket (WeightBucket.crc32) is the CRC-32 of zlib (ISO-HDLC: polynomial
0x04C11DB7 reflected, initial value and final xor 0xFFFFFFFF) over the bucket's bytes, padding
included; every transport checks it the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from rlfabric.core import codec
from rlfabric.core.errors import InvalidArgument, ResourceExhausted
from rlfabric.v1 import weight_sync_pb2

TRANSPORTS = ("nccl", "gloo", "grpc", "cuda_ipc")
_TRANSPORT_WIRE = {
    "nccl": weight_sync_pb2.WEIGHT_TRANSPORT_NCCL,
    "gloo": weight_sync_pb2.WEIGHT_TRANSPORT_GLOO,
    "grpc": weight_sync_pb2.WEIGHT_TRANSPORT_GRPC,
    "cuda_ipc": weight_sync_pb2.WEIGHT_TRANSPORT_CUDA_IPC,
}
_TRANSPORT_NAME = {wire: name for name, wire in _TRANSPORT_WIRE.items()}
# Tensors start at multiples of this many bytes inside a bucket, so every dtype can view its slice.
ALIGNMENT = 64
# Most ranks of one group (the sender included). Far above any mesh (gloo connects every pair of ranks),
# far below what torch's int32 ranks and a rank's per-peer tables could take from an absurd request.
MAX_WORLD_SIZE = 1 << 14


def aligned(num_bytes: int) -> int:
    """`num_bytes` rounded up to the next multiple of ALIGNMENT."""
    return (num_bytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def transport_to_proto(name: str) -> int:
    """"nccl" | "gloo" | "grpc" | "cuda_ipc" -> WeightTransport; "auto" or "" -> UNSPECIFIED (the actor chooses)."""
    return _TRANSPORT_WIRE.get(name, weight_sync_pb2.WEIGHT_TRANSPORT_UNSPECIFIED)


def transport_from_proto(wire: int) -> str:
    """WeightTransport -> "nccl" | "gloo" | "grpc" | "cuda_ipc"; "" for UNSPECIFIED."""
    return _TRANSPORT_NAME.get(wire, "")


@dataclass(frozen=True)
class SyncGroup:
    """Everything a receiver needs to join the actor's group (rlfabric.v1.WeightSyncGroup)."""

    group_id: str
    transport: str  # "nccl" | "gloo" | "grpc" | "cuda_ipc"
    world_size: int  # the sender (rank 0) plus every receiver
    timeout_s: float
    store_host: str = ""  # gloo, cuda_ipc, torch_group
    store_port: int = 0  # gloo, cuda_ipc, torch_group
    nccl_unique_id: bytes = b""  # nccl (not torch_group)
    torch_group: bool = False  # a torch.distributed group an SGLang server can join (weight_sync.torch_group)
    device_uuid: str = ""  # cuda_ipc: the sender's GPU, which every receiver must hold

    def to_proto(self) -> weight_sync_pb2.WeightSyncGroup:
        return weight_sync_pb2.WeightSyncGroup(
            group_id=self.group_id, transport=transport_to_proto(self.transport), world_size=self.world_size,
            nccl_unique_id=self.nccl_unique_id, store_host=self.store_host, store_port=self.store_port,
            timeout_s=self.timeout_s, torch_group=self.torch_group, device_uuid=self.device_uuid)

    @property
    def checksums(self) -> str:
        """Where the buckets' CRC-32s travel: "manifest" (grpc pushes, torch groups: SGLang reads none of
        ours), "after" (gloo, nccl: one more broadcast after the last bucket, so the actor checksums while
        it sends) or "none" (cuda_ipc: the receivers copy from the actor's own memory, no byte travels)."""
        if self.transport == "cuda_ipc":
            return "none"
        return "after" if self.transport in ("gloo", "nccl") and not self.torch_group else "manifest"

    @classmethod
    def from_proto(cls, message: weight_sync_pb2.WeightSyncGroup, max_timeout_s: float = math.inf) -> SyncGroup:
        """The group a message describes; InvalidArgument naming the field when it cannot be joined. A
        receiver passes `max_timeout_s` (weight_sync.max_timeout_s): a join or collective blocks a
        thread for up to timeout_s."""
        transport = transport_from_proto(message.transport)
        if not message.group_id:
            raise InvalidArgument("weight-sync group has no group_id")
        if not transport:
            raise InvalidArgument(f"weight-sync group {message.group_id} has no transport")
        if not 2 <= message.world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument(f"weight-sync group {message.group_id}: world_size must be 2..{MAX_WORLD_SIZE}, "
                                  f"got {message.world_size}")
        if not (math.isfinite(message.timeout_s) and 0 < message.timeout_s <= max_timeout_s):
            cap = f" and at most weight_sync.max_timeout_s={max_timeout_s:g}" if math.isfinite(max_timeout_s) else ""
            raise InvalidArgument(f"weight-sync group {message.group_id}: timeout_s must be > 0{cap}, "
                                  f"got {message.timeout_s:g}")
        if message.torch_group and transport in ("grpc", "cuda_ipc"):
            raise InvalidArgument(f"{transport} group {message.group_id} cannot be a torch_group")
        if transport == "cuda_ipc" and not message.device_uuid:
            raise InvalidArgument(f"cuda_ipc group {message.group_id} needs device_uuid (the sender's GPU)")
        needs_store = transport in ("gloo", "cuda_ipc") or message.torch_group
        if needs_store and not (message.store_host and 0 < message.store_port < 65536):
            raise InvalidArgument(f"{transport} group {message.group_id} needs store_host and store_port")
        if transport == "nccl" and not message.torch_group and not message.nccl_unique_id:
            raise InvalidArgument(f"nccl group {message.group_id} needs nccl_unique_id")
        return cls(message.group_id, transport, message.world_size, message.timeout_s, message.store_host,
                   message.store_port, bytes(message.nccl_unique_id), message.torch_group, message.device_uuid)

    def check_rank(self, rank: int) -> None:
        if not 1 <= rank < self.world_size:
            raise InvalidArgument(f"receiver rank {rank} outside 1..{self.world_size - 1} of group {self.group_id}")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a bucket: `num_bytes` bytes at `offset`, cast to `dtype`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketSpec:
    """One flattened bucket: sent as a single collective (or stream of chunks)."""

    index: int
    num_bytes: int
    tensors: tuple[TensorSpec, ...]
    crc32: int = 0  # filled in once the bucket is packed


PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's module names
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA settings of an adapter-only sync (rlfabric.v1.LoraAdapterSpec): each targeted layer
    serves W + (alpha / rank) * B @ A."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # names or name suffixes, or ("all-linear",)

    @classmethod
    def of(cls, rank: int, alpha: float, target_modules: str | list[str] | tuple[str, ...]) -> AdapterSpec:
        """From actor.lora's fields (target_modules may be one string)."""
        targets = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
        return cls(int(rank), float(alpha), targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def targets(self, module: str) -> bool:
        """Whether the layer named `module` (the base model's name) carries an adapter."""
        if self.target_modules == (ALL_LINEAR,):  # peft: every linear layer but the output head
            return module.rsplit(".", 1)[-1] not in ("lm_head", "embed_tokens")
        return any(module == t or module.endswith(f".{t}") for t in self.target_modules)

    def to_proto(self) -> weight_sync_pb2.LoraAdapterSpec:
        return weight_sync_pb2.LoraAdapterSpec(rank=self.rank, alpha=self.alpha, target_modules=self.target_modules)

    @classmethod
    def from_proto(cls, message: weight_sync_pb2.LoraAdapterSpec) -> AdapterSpec:
        if message.rank <= 0:
            raise InvalidArgument(f"weight manifest lora_adapter: rank {message.rank} must be > 0")
        if not (math.isfinite(message.alpha) and message.alpha > 0):
            raise InvalidArgument(f"weight manifest lora_adapter: alpha {message.alpha} must be > 0")
        if not message.target_modules or not all(message.target_modules):
            raise InvalidArgument("weight manifest lora_adapter: target_modules must name at least one layer")
        return cls(message.rank, message.alpha, tuple(message.target_modules))


def adapter_tensor_name(module: str, part: str) -> str:
    """The wire (and peft file) name of a layer's lora_A or lora_B weight: part is "A" or "B"."""
    return f"{PEFT_PREFIX}{module}.lora_{part}.weight"


def parse_adapter_tensor_name(name: str) -> tuple[str, str] | None:
    """(base model module name, "A" or "B") of an adapter tensor's wire name, else None."""
    if not name.startswith(PEFT_PREFIX):
        return None
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if name.endswith(suffix):
            return name[len(PEFT_PREFIX): -len(suffix)], part
    return None


DELTA_ENCODINGS = ("unchanged", "sparse", "xor_zstd", "raw")  # rlfabric.v1.DeltaEncoding, in wire order from 1


@dataclass(frozen=True)
class TensorDelta:
    """How one tensor of a delta sync changed (rlfabric.v1.WeightTensorDelta): its encoding (DELTA_ENCODINGS)
    and the CRC-32 of its bytes once the change is applied."""

    name: str
    encoding: str
    crc32: int


@dataclass(frozen=True)
class DeltaSpec:
    """A delta sync (rlfabric.v1.WeightDelta): the manifest's buckets carry encoded changes against
    `base_version`; `layout` is the full buckets they rebuild, `tensors` every layout tensor's encoding."""

    base_version: int
    layout: tuple[BucketSpec, ...]
    tensors: tuple[TensorDelta, ...]

    @property
    def full_bytes(self) -> int:
        """What the full sync of this version moves."""
        return sum(b.num_bytes for b in self.layout)


@dataclass(frozen=True)
class Manifest:
    """One sync: receivers serve `version` once every bucket has landed and checked out. With
    `adapter`, the buckets hold LoRA adapters alone (peft names) rather than full weights. With `delta`, they
    hold each changed tensor's encoded change against the base the receiver kept (`keep_base` on the sync that
    brought it)."""

    version: int
    group_id: str
    buckets: tuple[BucketSpec, ...] = field(default_factory=tuple)
    adapter: AdapterSpec | None = None
    keep_base: bool = False
    delta: DeltaSpec | None = None

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)

    @property
    def full_bytes(self) -> int:
        """The full weights' bytes (num_bytes unless this is a delta)."""
        return self.delta.full_bytes if self.delta is not None else self.num_bytes

    def to_proto(self) -> weight_sync_pb2.WeightManifest:
        message = weight_sync_pb2.WeightManifest(version=self.version, group_id=self.group_id,
                                                 buckets=_buckets_to_proto(self.buckets), keep_base=self.keep_base)
        if self.adapter is not None:
            message.lora_adapter.CopyFrom(self.adapter.to_proto())
        if self.delta is not None:
            message.delta.CopyFrom(weight_sync_pb2.WeightDelta(
                base_version=self.delta.base_version, layout=_buckets_to_proto(self.delta.layout), tensors=[
                    weight_sync_pb2.WeightTensorDelta(name=t.name, encoding=DELTA_ENCODINGS.index(t.encoding) + 1,
                                                      crc32=t.crc32) for t in self.delta.tensors]))
        return message

    @classmethod
    def from_proto(cls, message: weight_sync_pb2.WeightManifest) -> Manifest:
        """The manifest, after checking it describes buckets a receiver can safely slice."""
        if message.version < 0:
            raise InvalidArgument(f"weight manifest version {message.version} < 0")
        delta = _delta_from_proto(message) if message.HasField("delta") else None
        if not message.buckets and delta is None:  # a delta where nothing changed has none
            raise InvalidArgument("weight manifest has no buckets")
        adapter = AdapterSpec.from_proto(message.lora_adapter) if message.HasField("lora_adapter") else None
        if delta is not None and adapter is not None:
            raise InvalidArgument("weight manifest: a delta of LoRA adapters is not supported")
        return cls(message.version, message.group_id, _buckets_from_proto(message.buckets, "weight manifest"), adapter,
                   message.keep_base, delta)


def _buckets_to_proto(buckets: tuple[BucketSpec, ...]) -> list[weight_sync_pb2.WeightBucket]:
    return [weight_sync_pb2.WeightBucket(index=b.index, num_bytes=b.num_bytes, crc32=b.crc32, tensors=[
        weight_sync_pb2.WeightTensorSpec(name=t.name, dtype=codec.wire_dtype(t.dtype), shape=t.shape, offset=t.offset)
        for t in b.tensors]) for b in buckets]


def _delta_from_proto(message: weight_sync_pb2.WeightManifest) -> DeltaSpec:
    """The delta of a manifest: a layout like a full manifest's, every layout tensor's encoding once, and a
    bucket entry (uint8, 1-D, at most the tensor's own bytes) for exactly the tensors that are not unchanged."""
    delta = message.delta
    if not 0 <= delta.base_version <= message.version:
        raise InvalidArgument(f"weight manifest version {message.version}: delta base version {delta.base_version} "
                              "must be >= 0 and not newer")
    if not delta.layout:
        raise InvalidArgument("weight manifest delta has no layout buckets")
    layout = _buckets_from_proto(delta.layout, "weight manifest delta layout")
    specs = [t for b in layout for t in b.tensors]
    if [t.name for t in delta.tensors] != [t.name for t in specs]:
        raise InvalidArgument("weight manifest delta: its tensors must be the layout's, in layout order")
    tensors = []
    for tensor in delta.tensors:
        if not 1 <= tensor.encoding <= len(DELTA_ENCODINGS):
            raise InvalidArgument(f"weight manifest delta tensor {tensor.name!r}: unknown encoding {tensor.encoding}")
        tensors.append(TensorDelta(tensor.name, DELTA_ENCODINGS[tensor.encoding - 1], tensor.crc32))
    sizes = {t.name: t.num_bytes for t in specs}
    sent = {}
    for bucket in message.buckets:
        for entry in bucket.tensors:
            if (entry.name not in sizes or entry.name in sent or codec.torch_dtype(entry.dtype) != torch.uint8
                    or len(entry.shape) != 1 or entry.shape[0] > sizes[entry.name]):
                raise InvalidArgument(f"weight manifest delta entry {entry.name!r}: not a tensor of the layout, "
                                      "repeated, or not uint8 bytes of at most the tensor's size")
            sent[entry.name] = entry.shape[0]
    encoded = {t.name for t in tensors if t.encoding != "unchanged"}
    if set(sent) != encoded:
        raise InvalidArgument(f"weight manifest delta: the buckets carry {len(sent)} entries for {len(encoded)} "
                              "changed tensors (every changed tensor exactly once, no unchanged one)")
    return DeltaSpec(delta.base_version, layout, tuple(tensors))


def _buckets_from_proto(messages, what: str) -> tuple[BucketSpec, ...]:
    """Buckets a receiver can safely slice: in order, each its tensors packed at aligned offsets, nothing more."""
    buckets, names = [], set()
    for position, bucket in enumerate(messages):
        if bucket.index != position:
            raise InvalidArgument(f"{what} bucket {position} has index {bucket.index}")
        if bucket.num_bytes <= 0:
            raise InvalidArgument(f"{what} bucket {position} has {bucket.num_bytes} bytes")
        tensors = []
        for spec in bucket.tensors:
            tensor = TensorSpec(spec.name, codec.torch_dtype(spec.dtype), tuple(spec.shape), spec.offset)
            where = f"{what} bucket {position} tensor {spec.name!r}"
            if not spec.name or spec.name in names:
                raise InvalidArgument(f"{where}: empty or repeated name")
            if any(d < 0 for d in tensor.shape) or spec.offset < 0 or spec.offset % ALIGNMENT:
                raise InvalidArgument(f"{where}: negative dimension or misaligned offset {spec.offset}")
            if spec.offset + tensor.num_bytes > bucket.num_bytes:
                raise InvalidArgument(f"{where}: bytes {spec.offset}..{spec.offset + tensor.num_bytes} "
                                      f"outside the bucket's {bucket.num_bytes}")
            names.add(spec.name)
            tensors.append(tensor)
        # A bucket is its tensors packed at aligned offsets, nothing more: without this, one
        # announced number would decide how much memory the receiver maps.
        packed = sum(aligned(t.num_bytes) for t in tensors)
        if bucket.num_bytes > packed:
            raise InvalidArgument(f"{what} bucket {position} announces {bucket.num_bytes} bytes but its "
                                  f"{len(tensors)} tensor(s) fill only {packed} (aligned)")
        buckets.append(BucketSpec(bucket.index, bucket.num_bytes, tuple(tensors), bucket.crc32))
    return tuple(buckets)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class WeightLimits:
    """The weights a receiver holds, by Hugging Face name: what a manifest may announce to it.

    check() runs before any bucket is allocated: every announced tensor must be one of the
    receiver's own with the same shape (and, where `dtypes` names it, a floating-point dtype exactly
    when the receiver's is one: floats may arrive cast), and the whole manifest must fit in
    `max_bytes`. Together with the manifest's own checks (a bucket is its tensors packed, no more)
    this bounds what a sync can make the receiver map by the size of its own model."""

    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    what: str = "this model"  # how error messages name the receiver's model
    adapter: AdapterSpec | None = None  # the LoRA adapter this receiver applies; None: it takes full weights only

    @classmethod
    def of(cls, named: Mapping[str, torch.Tensor], what: str = "this model") -> WeightLimits:
        """The limits of named tensors (a model's parameters and buffers)."""
        return cls({n: tuple(t.shape) for n, t in named.items()}, {n: t.dtype for n, t in named.items()}, what)

    @classmethod
    def from_checkpoint(cls, path: str) -> WeightLimits | None:
        """The limits of a Hugging Face checkpoint directory, from its safetensors headers (nothing is
        loaded); None when `path` is not a local directory with safetensors files (a hub name)."""
        from pathlib import Path

        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
        if not files:
            return None
        shapes, dtypes = {}, {}
        for file in files:
            with safe_open(str(file), framework="pt") as checkpoint:
                for name in checkpoint.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = checkpoint.get_slice(name)
                    shapes[name] = tuple(tensor.get_shape())
                    dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype())
                    if dtype is not None:
                        dtypes[name] = dtype
        return cls(shapes, dtypes, f"checkpoint {path}")

    @property
    def max_bytes(self) -> int:
        """The most a manifest may carry: every weight at 8 bytes an element (the widest dtype a
        weight travels in), aligned."""
        return sum(aligned(math.prod(shape) * 8) for shape in self.shapes.values())

    def check(self, manifest: Manifest) -> None:
        """InvalidArgument for a tensor this receiver does not have (or of another shape or kind);
        ResourceExhausted for a manifest larger than this receiver's weights can be."""
        if manifest.adapter is not None:
            return self.check_adapter(manifest)
        if manifest.delta is not None:  # its buckets are bounded by the layout's tensors (Manifest.from_proto)
            manifest = Manifest(manifest.version, manifest.group_id, manifest.delta.layout)
        for bucket in manifest.buckets:
            for tensor in bucket.tensors:
                where = f"weight manifest version {manifest.version} bucket {bucket.index} tensor {tensor.name!r}"
                shape = self.shapes.get(tensor.name)
                if shape is None:
                    raise InvalidArgument(f"{where}: {self.what} has no weight of that name")
                if tuple(tensor.shape) != tuple(shape):
                    raise InvalidArgument(f"{where}: shape {tuple(tensor.shape)}, {self.what}'s is {tuple(shape)}")
                own = self.dtypes.get(tensor.name)
                if own is not None and own.is_floating_point != tensor.dtype.is_floating_point:
                    raise InvalidArgument(f"{where}: dtype {tensor.dtype} where {self.what} has {own}")
        if manifest.num_bytes > self.max_bytes:
            raise ResourceExhausted(f"weight manifest version {manifest.version} announces {manifest.num_bytes} bytes; "
                                    f"{self.what}'s weights take at most {self.max_bytes}")

    def check_adapter(self, manifest: Manifest) -> None:
        """An adapter-only manifest against the base model's layers: every tensor is the lora_A
        (rank, in_features) or lora_B (out_features, rank) of a targeted 2-D weight of this model, both
        halves of every layer arrive, the rank is at most the layer's smaller dimension, and the bytes
        are at most what such an adapter takes (so a manifest cannot make the receiver map more)."""
        adapter = manifest.adapter
        if self.adapter is None:
            raise InvalidArgument(f"weight manifest version {manifest.version} carries a LoRA adapter; {self.what} "
                                  "is served without adapters (its run has no actor.lora, or weight_sync.lora merged)")
        if adapter != self.adapter:
            raise InvalidArgument(f"weight manifest version {manifest.version} carries a LoRA adapter {adapter}; "
                                  f"{self.what} serves {self.adapter} (actor.lora must be the same for both)")
        halves: dict[str, set[str]] = {}
        for bucket in manifest.buckets:
            for tensor in bucket.tensors:
                where = f"weight manifest version {manifest.version} bucket {bucket.index} tensor {tensor.name!r}"
                parsed = parse_adapter_tensor_name(tensor.name)
                if parsed is None:
                    raise InvalidArgument(f"{where}: not a LoRA adapter weight ({PEFT_PREFIX}<layer>.lora_A.weight "
                                          "or .lora_B.weight) in an adapter manifest")
                module, part = parsed
                weight = self.shapes.get(f"{module}.weight")
                if weight is None or len(weight) != 2:
                    raise InvalidArgument(f"{where}: {self.what} has no 2-D layer weight {module}.weight")
                if not adapter.targets(module):
                    raise InvalidArgument(f"{where}: layer {module} is not among the adapter's target_modules "
                                          f"{list(adapter.target_modules)}")
                out_features, in_features = weight
                if adapter.rank > min(in_features, out_features):
                    raise InvalidArgument(f"{where}: rank {adapter.rank} exceeds layer {module} ({in_features} -> "
                                          f"{out_features})")
                expected = (adapter.rank, in_features) if part == "A" else (out_features, adapter.rank)
                if tuple(tensor.shape) != expected:
                    raise InvalidArgument(f"{where}: shape {tuple(tensor.shape)}, a rank-{adapter.rank} lora_{part} "
                                          f"of {module} is {expected}")
                if not tensor.dtype.is_floating_point:
                    raise InvalidArgument(f"{where}: dtype {tensor.dtype} is not floating point")
                halves.setdefault(module, set()).add(part)
        lonely = sorted(module for module, parts in halves.items() if parts != {"A", "B"})
        if lonely:
            raise InvalidArgument(f"weight manifest version {manifest.version}: layer(s) {', '.join(lonely[:3])} "
                                  "carry only one of lora_A and lora_B")
        most = sum(aligned(adapter.rank * (shape[0] + shape[1]) * 8) for name, shape in self.shapes.items()
                   if name.endswith(".weight") and len(shape) == 2 and adapter.targets(name[: -len(".weight")]))
        if manifest.num_bytes > most:
            raise ResourceExhausted(f"weight manifest version {manifest.version} announces {manifest.num_bytes} "
                                    f"bytes; a rank-{adapter.rank} adapter of {self.what} takes at most {most}")
