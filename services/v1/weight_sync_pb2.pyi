from rlfabric.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_NCCL: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_GLOO: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_GRPC: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_CUDA_IPC: _ClassVar[WeightTransport]

class DeltaEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_ENCODING_UNSPECIFIED: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_UNCHANGED: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_SPARSE: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_XOR_ZSTD: _ClassVar[DeltaEncoding]
    DELTA_ENCODING_RAW: _ClassVar[DeltaEncoding]
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_NCCL: WeightTransport
WEIGHT_TRANSPORT_GLOO: WeightTransport
WEIGHT_TRANSPORT_GRPC: WeightTransport
WEIGHT_TRANSPORT_CUDA_IPC: WeightTransport
DELTA_ENCODING_UNSPECIFIED: DeltaEncoding
DELTA_ENCODING_UNCHANGED: DeltaEncoding
DELTA_ENCODING_SPARSE: DeltaEncoding
DELTA_ENCODING_XOR_ZSTD: DeltaEncoding
DELTA_ENCODING_RAW: DeltaEncoding

class WeightSyncGroup(_message.Message):
    __slots__ = ("group_id", "transport", "world_size", "nccl_unique_id", "store_host", "store_port", "timeout_s", "torch_group", "device_uuid")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TORCH_GROUP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    transport: WeightTransport
    world_size: int
    nccl_unique_id: bytes
    store_host: str
    store_port: int
    timeout_s: float
    torch_group: bool
    device_uuid: str
    def __init__(self, group_id: _Optional[str] = ..., transport: _Optional[_Union[WeightTransport, str]] = ..., world_size: _Optional[int] = ..., nccl_unique_id: _Optional[bytes] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., timeout_s: _Optional[float] = ..., torch_group: _Optional[bool] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class WeightTensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("index", "num_bytes", "crc32", "tensors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_bytes: int
    crc32: int
    tensors: _containers.RepeatedCompositeFieldContainer[WeightTensorSpec]
    def __init__(self, index: _Optional[int] = ..., num_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[WeightTensorSpec, _Mapping]]] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "group_id", "buckets", "lora_adapter", "keep_base", "delta")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    KEEP_BASE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    version: int
    group_id: str
    buckets: _containers.RepeatedCompositeFieldContainer[WeightBucket]
    lora_adapter: LoraAdapterSpec
    keep_base: bool
    delta: WeightDelta
    def __init__(self, version: _Optional[int] = ..., group_id: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[WeightBucket, _Mapping]]] = ..., lora_adapter: _Optional[_Union[LoraAdapterSpec, _Mapping]] = ..., keep_base: _Optional[bool] = ..., delta: _Optional[_Union[WeightDelta, _Mapping]] = ...) -> None: ...

class WeightDelta(_message.Message):
    __slots__ = ("base_version", "layout", "tensors")
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    layout: _containers.RepeatedCompositeFieldContainer[WeightBucket]
    tensors: _containers.RepeatedCompositeFieldContainer[WeightTensorDelta]
    def __init__(self, base_version: _Optional[int] = ..., layout: _Optional[_Iterable[_Union[WeightBucket, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[WeightTensorDelta, _Mapping]]] = ...) -> None: ...

class WeightTensorDelta(_message.Message):
    __slots__ = ("name", "encoding", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    encoding: DeltaEncoding
    crc32: int
    def __init__(self, name: _Optional[str] = ..., encoding: _Optional[_Union[DeltaEncoding, str]] = ..., crc32: _Optional[int] = ...) -> None: ...

class LoraAdapterSpec(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightSyncDevice(_message.Message):
    __slots__ = ("device", "uuid")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    device: str
    uuid: str
    def __init__(self, device: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class WeightSyncPhases(_message.Message):
    __slots__ = ("gather_s", "pack_s", "checksum_s", "wire_s", "apply_s")
    GATHER_S_FIELD_NUMBER: _ClassVar[int]
    PACK_S_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_S_FIELD_NUMBER: _ClassVar[int]
    WIRE_S_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    gather_s: float
    pack_s: float
    checksum_s: float
    wire_s: float
    apply_s: float
    def __init__(self, gather_s: _Optional[float] = ..., pack_s: _Optional[float] = ..., checksum_s: _Optional[float] = ..., wire_s: _Optional[float] = ..., apply_s: _Optional[float] = ...) -> None: ...

class CudaIpcBucket(_message.Message):
    __slots__ = ("group_id", "version", "bucket_index", "slot", "num_bytes", "device_uuid", "handles")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    version: int
    bucket_index: int
    slot: int
    num_bytes: int
    device_uuid: str
    handles: _containers.RepeatedCompositeFieldContainer[CudaIpcHandle]
    def __init__(self, group_id: _Optional[str] = ..., version: _Optional[int] = ..., bucket_index: _Optional[int] = ..., slot: _Optional[int] = ..., num_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ..., handles: _Optional[_Iterable[_Union[CudaIpcHandle, _Mapping]]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("mem_handle", "storage_offset", "storage_size", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    storage_offset: int
    storage_size: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, mem_handle: _Optional[bytes] = ..., storage_offset: _Optional[int] = ..., storage_size: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...
