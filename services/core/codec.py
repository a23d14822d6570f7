"""Tensor wire format: torch / numpy <-> rlfabric.v1.Tensor, Batch and TensorChunk streams.

A Tensor is dtype + shape + raw little-endian row-major bytes. Decoding wraps the bytes without
per-element work (np.frombuffer / torch.frombuffer): the result is read-only, so pass `copy=True`
when you need to write into it. Through protobuf's Python runtime (upb), encode copies the tensor
once into a bytes object and once into the message (and serializing copies it again); decode reads
the bytes field once (upb materialises it) and wraps that buffer. A client's bulk request (a step's
batch, hundreds of MB) is written by serialized_with_batch instead: one copy, from the tensors'
memory into the request's bytes.

Every decode checks the message first (known dtype, non-negative dims, sane element count,
byte length == elements * itemsize) and raises InvalidArgument naming what is wrong.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlfabric.core.errors import InvalidArgument
from rlfabric.v1 import tensor_pb2

DataType = tensor_pb2.DataType

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# No legitimate tensor in this system has 2**40 elements (4 TiB of float32).
MAX_ELEMENTS = 1 << 40


@dataclass(frozen=True)
class _DTypeInfo:
    wire: int
    torch_dtype: torch.dtype
    numpy_dtype: np.dtype | None  # None: numpy has no such type (bfloat16)
    itemsize: int


_DTYPES = [
    _DTypeInfo(DataType.DATA_TYPE_FLOAT32, torch.float32, np.dtype("<f4"), 4),
    _DTypeInfo(DataType.DATA_TYPE_FLOAT16, torch.float16, np.dtype("<f2"), 2),
    _DTypeInfo(DataType.DATA_TYPE_BFLOAT16, torch.bfloat16, None, 2),
    _DTypeInfo(DataType.DATA_TYPE_INT64, torch.int64, np.dtype("<i8"), 8),
    _DTypeInfo(DataType.DATA_TYPE_INT32, torch.int32, np.dtype("<i4"), 4),
    _DTypeInfo(DataType.DATA_TYPE_UINT8, torch.uint8, np.dtype("u1"), 1),
    _DTypeInfo(DataType.DATA_TYPE_BOOL, torch.bool, np.dtype("?"), 1),
]
_BY_WIRE = {d.wire: d for d in _DTYPES}
_BY_TORCH = {d.torch_dtype: d for d in _DTYPES}
_BY_NUMPY = {d.numpy_dtype.newbyteorder("="): d for d in _DTYPES if d.numpy_dtype is not None}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("rlfabric's zero-copy tensor codec needs a little-endian host")


def wire_dtype(dtype: torch.dtype | np.dtype) -> int:
    """The DataType enum value for a torch or numpy dtype; InvalidArgument if unsupported."""
    info = _BY_TORCH.get(dtype) if isinstance(dtype, torch.dtype) else _BY_NUMPY.get(np.dtype(dtype).newbyteorder("="))
    if info is None:
        raise InvalidArgument(f"unsupported tensor dtype {dtype}")
    return info.wire


def torch_dtype(wire: int) -> torch.dtype:
    """The torch dtype for a DataType enum value; InvalidArgument if unknown."""
    return _dtype_info(wire).torch_dtype


def _dtype_info(wire: int, tensor_name: str | None = None) -> _DTypeInfo:
    info = _BY_WIRE.get(wire)
    if info is None:
        name = DataType.Name(wire) if wire in DataType.values() else str(wire)
        where = f"{tensor_name}: " if tensor_name else ""
        raise InvalidArgument(f"{where}unknown or unspecified tensor dtype {name}")
    return info


def encode(value: torch.Tensor | np.ndarray) -> tensor_pb2.Tensor:
    """Encodes a torch tensor or numpy array (any layout, CPU or GPU) as a Tensor message."""
    message = tensor_pb2.Tensor()
    encode_into(message, value)
    return message


def encode_into(message: tensor_pb2.Tensor, value: torch.Tensor | np.ndarray) -> None:
    """Encodes `value` into `message` in place, e.g. a field of the request that carries it: a Tensor built
    on its own and then assigned is copied again, bytes and all (each copy of a batch costs its size in
    memory and ~0.1 s per 100 MB)."""
    info, shape, array = _wire_array(value)
    message.dtype = info.wire
    del message.shape[:]
    message.shape.extend(shape)
    message.raw_data = array.tobytes()


def _wire_array(value: torch.Tensor | np.ndarray) -> tuple[_DTypeInfo, tuple[int, ...], np.ndarray]:
    """The dtype, shape and a C-contiguous little-endian CPU array of `value`'s bytes (itself when it is one)."""
    if isinstance(value, torch.Tensor):
        info = _BY_TORCH.get(value.dtype)
        if info is None:
            raise InvalidArgument(f"unsupported tensor dtype {value.dtype}")
        flat = value.detach().to("cpu").contiguous()
        if flat.dtype == torch.bfloat16:  # numpy has no bfloat16: move the same 2 bytes as int16
            flat = flat.view(torch.int16)
        array = flat.numpy()
        shape = tuple(value.shape)
    else:
        array = np.asarray(value)
        info = _BY_NUMPY.get(array.dtype.newbyteorder("="))
        if info is None:
            raise InvalidArgument(f"unsupported array dtype {array.dtype}")
        shape = array.shape
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return info, shape, np.ascontiguousarray(array)


def check(message: tensor_pb2.Tensor, name: str = "tensor", raw: bytes | None = None) -> tuple[_DTypeInfo, tuple[int, ...]]:
    """Validates a Tensor message; returns its dtype info and shape. Raises InvalidArgument.

    Pass `raw` when you already hold message.raw_data: with the upb runtime every read of a bytes
    field materialises a new copy, so decoders read it exactly once.
    """
    raw = message.raw_data if raw is None else raw
    info = _dtype_info(message.dtype, name)
    shape = tuple(message.shape)
    expected = _checked_numel(shape, name) * info.itemsize
    if len(raw) != expected:
        raise InvalidArgument(
            f"{name}: raw_data has {len(raw)} bytes but shape {list(shape)} of "
            f"{DataType.Name(info.wire)} needs {expected}"
        )
    return info, shape


def _checked_numel(shape: tuple[int, ...], name: str) -> int:
    """The element count of a wire shape; InvalidArgument for negative or absurd dimensions."""
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{name}: negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if numel > MAX_ELEMENTS:
        raise InvalidArgument(f"{name}: shape {list(shape)} has {numel} elements, more than the limit {MAX_ELEMENTS}")
    # A 0 among huge dimensions makes an empty tensor that numpy cannot even reshape to: refuse those too.
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise InvalidArgument(f"{name}: shape {list(shape)} is too large: its non-zero dimensions multiply to "
                              f"more than the limit {MAX_ELEMENTS}")
    return numel


def to_numpy(message: tensor_pb2.Tensor, name: str = "tensor", copy: bool = False) -> np.ndarray:
    """Decodes to a numpy array (read-only view of the message bytes unless copy=True).

    bfloat16 has no numpy type: use to_torch for it.
    """
    raw = message.raw_data
    info, shape = check(message, name, raw)
    if info.numpy_dtype is None:
        raise InvalidArgument(f"{name}: {DataType.Name(info.wire)} has no numpy type; decode it with to_torch")
    array = np.frombuffer(raw, dtype=info.numpy_dtype).reshape(shape)
    return array.copy() if copy else array


def to_torch(message: tensor_pb2.Tensor, name: str = "tensor", copy: bool = False) -> torch.Tensor:
    """Decodes to a CPU torch tensor sharing the message bytes (no per-element work).

    The shared tensor must not be written to; pass copy=True for a writable one.
    """
    raw = message.raw_data
    info, shape = check(message, name, raw)
    if len(raw) == 0:
        return torch.empty(shape, dtype=info.torch_dtype)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable; we document read-only and offer copy=True.
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.frombuffer(raw, dtype=info.torch_dtype).reshape(shape)
    return tensor.clone() if copy else tensor


# ---------------------------------------------------------------------------------------------
# Batches


def encode_batch(
    tensors: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    columns: Mapping[str, Sequence[str]] | None = None,
    out: tensor_pb2.Batch | None = None,
) -> tensor_pb2.Batch:
    """Builds a Batch from named tensors and named per-row string columns; into `out` (the request's own
    Batch field, so the batch is not copied into it again) when given."""
    batch = tensor_pb2.Batch() if out is None else out
    for name, value in (tensors or {}).items():
        encode_into(batch.tensors[name], value)
    for name, values in (columns or {}).items():
        batch.columns[name].values.extend(values)
    return batch


def serialized_with_batch(message, path: Sequence[str], tensors: Mapping[str, torch.Tensor | np.ndarray]) -> bytes:
    """`message` serialized with `tensors` as the Batch at `path` (field names from `message` down: ("batch",),
    or ("input", "batch") for a LogProbsInput's), for a call with request_serializer=None
    (ServiceClient.call_serialized). The same message a parser reads from the protobuf-built one, but each
    tensor's data is copied once, from its own memory into the request's bytes: protobuf's own path copies
    it three times (into a bytes object, into the message, into the serialized request), and a step's update
    batch is hundreds of MB. The fields before the batch go first; protobuf reads fields in any order."""
    pieces: list = []
    for name, value in tensors.items():
        info, shape, array = _wire_array(value)
        data = memoryview(array).cast("B") if array.size else memoryview(b"")
        head = tensor_pb2.Tensor(dtype=info.wire, shape=shape).SerializeToString()
        tensor = [head, *(_length_prefixed(_RAW_DATA, [data]) if len(data) else [])]
        pieces += _length_prefixed(_BATCH_TENSORS, [*_length_prefixed(1, [name.encode()]),
                                                    *_length_prefixed(2, tensor)])
    holders = [message]
    for name in path[:-1]:
        holders.append(getattr(holders[-1], name))
    for holder, name in reversed(list(zip(holders, path, strict=True))):
        rest = type(holder)()
        rest.CopyFrom(holder)
        rest.ClearField(name)
        pieces = [rest.SerializeToString(), *_length_prefixed(holder.DESCRIPTOR.fields_by_name[name].number, pieces)]
    return b"".join(pieces)


def _length_prefixed(number: int, pieces: list) -> list:
    """A length-delimited field (wire type 2): its key and length, then `pieces`."""
    return [varint(number << 3 | 2) + varint(sum(len(piece) for piece in pieces)), *pieces]


def varint(value: int) -> bytes:
    """A protobuf varint (an unsigned value: a field key, a length)."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_BATCH_TENSORS = tensor_pb2.Batch.DESCRIPTOR.fields_by_name["tensors"].number
_RAW_DATA = tensor_pb2.Tensor.DESCRIPTOR.fields_by_name["raw_data"].number


@dataclass
class DecodedBatch:
    """A validated Batch: torch tensors and string columns, all with `num_rows` rows."""

    tensors: dict[str, torch.Tensor]
    columns: dict[str, list[str]]
    num_rows: int

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def decode_batch(
    batch: tensor_pb2.Batch,
    required: Iterable[str] = (),
    optional: Iterable[str] = (),
    allow_empty: bool = False,
    copy: bool = False,
) -> DecodedBatch:
    """Decodes and validates a Batch.

    Every tensor is decoded (so a malformed one is an InvalidArgument), every name in `required`
    must be present, names outside required + optional are rejected when either is given, and all
    tensors and columns must agree on the row count (first dimension).
    """
    check_batch_names(batch.tensors, required, optional)
    tensors = {name: to_torch(msg, name=name, copy=copy) for name, msg in batch.tensors.items()}
    columns = {name: list(col.values) for name, col in batch.columns.items()}
    row_counts = {name: (t.shape[0] if t.dim() > 0 else None) for name, t in tensors.items()}
    row_counts.update({name: len(values) for name, values in columns.items()})
    num_rows = _check_row_counts(row_counts, allow_empty)
    return DecodedBatch(tensors=tensors, columns=columns, num_rows=num_rows)


def check_batch(tensors: Mapping[str, torch.Tensor], required: Iterable[str] = (), optional: Iterable[str] = (),
                allow_empty: bool = False) -> int:
    """decode_batch's checks on a batch that never was on the wire (an in-process client's): the same
    InvalidArgument for the same fault. Returns the row count."""
    check_batch_names(tensors, required, optional)
    return _check_row_counts({name: (t.shape[0] if t.dim() > 0 else None) for name, t in tensors.items()},
                             allow_empty)


def check_batch_names(names: Iterable[str], required: Iterable[str] = (), optional: Iterable[str] = ()) -> None:
    """Every name in `required` is present; when either is given, no name outside required + optional."""
    names = set(names)
    required = list(required)
    known = set(required) | set(optional)
    missing = [n for n in required if n not in names]
    if missing:
        raise InvalidArgument(f"batch is missing tensor(s) {missing}; it has {sorted(names)}")
    if known:
        unknown = sorted(names - known)
        if unknown:
            raise InvalidArgument(f"batch has unexpected tensor(s) {unknown}; expected {sorted(known)}")


def _check_row_counts(row_counts: Mapping[str, int | None], allow_empty: bool) -> int:
    scalars = [n for n, r in row_counts.items() if r is None]
    if scalars:
        raise InvalidArgument(f"batch tensor(s) {scalars} are scalars; every tensor needs a row dimension")
    distinct = set(row_counts.values())
    if len(distinct) > 1:
        raise InvalidArgument(f"batch entries disagree on the row count: {dict(row_counts)}")
    num_rows = distinct.pop() if distinct else 0
    if num_rows == 0 and not allow_empty:
        raise InvalidArgument("batch is empty (0 rows)")
    return num_rows


# ---------------------------------------------------------------------------------------------
# Chunked streaming, for payloads above the message size limit (weights, big batches)


def iter_chunks(
    name: str, value: torch.Tensor | np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tensor_pb2.TensorChunk]:
    """Splits one tensor into TensorChunk messages of at most chunk_bytes data each."""
    if chunk_bytes <= 0:
        raise InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
    whole = encode(value)
    raw = memoryview(whole.raw_data)
    total = len(raw)
    offset = 0
    while True:
        piece = raw[offset : offset + chunk_bytes]
        yield tensor_pb2.TensorChunk(
            name=name, dtype=whole.dtype, shape=whole.shape, offset=offset, total_bytes=total, data=bytes(piece)
        )
        offset += len(piece)
        if offset >= total:
            return


class ChunkAssembler:
    """Reassembles TensorChunk streams (possibly interleaving several tensors) into tensors.

    feed() returns (name, tensor) when a tensor's last chunk arrives, else None. Out-of-order
    or overlapping chunks, header changes mid-tensor and totals that disagree with the shape
    are InvalidArgument; so is a tensor larger than max_total_bytes.
    """

    def __init__(self, max_total_bytes: int = 1 << 40):
        self.max_total_bytes = max_total_bytes
        self._partial: dict[str, tuple[tensor_pb2.TensorChunk, bytearray, int]] = {}

    def feed(self, chunk: tensor_pb2.TensorChunk) -> tuple[str, torch.Tensor] | None:
        name = chunk.name
        if name not in self._partial:
            if chunk.offset != 0:
                raise InvalidArgument(f"chunk stream for {name!r} starts at offset {chunk.offset}, not 0")
            if chunk.total_bytes < 0 or chunk.total_bytes > self.max_total_bytes:
                raise InvalidArgument(f"chunk stream for {name!r} announces {chunk.total_bytes} bytes")
            info = _dtype_info(chunk.dtype, f"chunk stream for {name!r}")
            expected = _checked_numel(tuple(chunk.shape), f"chunk stream for {name!r}") * info.itemsize
            if expected != chunk.total_bytes:
                raise InvalidArgument(
                    f"chunk stream for {name!r}: total_bytes {chunk.total_bytes} does not match shape "
                    f"{list(chunk.shape)} of {DataType.Name(info.wire)}"
                )
            self._partial[name] = (chunk, bytearray(chunk.total_bytes), 0)
        first, buffer, received = self._partial[name]
        if chunk.offset != received:
            raise InvalidArgument(f"chunk for {name!r} at offset {chunk.offset}, expected {received}")
        if (chunk.dtype, list(chunk.shape), chunk.total_bytes) != (first.dtype, list(first.shape), first.total_bytes):
            raise InvalidArgument(f"chunk for {name!r} changes dtype, shape or total_bytes mid-stream")
        end = received + len(chunk.data)
        if end > first.total_bytes:
            raise InvalidArgument(f"chunks for {name!r} overrun total_bytes {first.total_bytes}")
        buffer[received:end] = chunk.data
        if end < first.total_bytes:
            self._partial[name] = (first, buffer, end)
            return None
        del self._partial[name]
        info = _dtype_info(first.dtype)
        tensor = torch.frombuffer(buffer, dtype=info.torch_dtype) if buffer else torch.empty(0, dtype=info.torch_dtype)
        return name, tensor.reshape(tuple(first.shape))

    @property
    def incomplete(self) -> list[str]:
        """Names of tensors whose last chunk has not arrived."""
        return sorted(self._partial)
