"""The model roles' batch (rlfabric.trainer.batch) without its padding: what UpdatePolicyStream carries.

In the padded layout row i's real tokens are one span of input_ids [B, P+T], columns [P - p_i, P + r_i): its
p_i prompt tokens, left-padded, then its r_i response tokens, right-padded. Unpadded, a batch is

    prompt_lengths, response_lengths  [B] int64           p_i, r_i
    sequence tensors   [sum(p + r), ...]   each row's span of a [B, P+T, ...] tensor, rows end to end
                                           (input_ids, position_ids, routed_experts)
    response tensors   [sum(r), ...]       each row's first r_i columns of a [B, T, ...] tensor
                                           (response_mask, advantages, old_log_probs, ...)

attention_mask (1 on the spans) and responses (input_ids' last T columns) follow from the lengths, and every
padding cell holds its tensor's fill (FILLS). A batch in exactly that layout goes as RaggedRows pieces
(Unpadded, client side) and comes back bit for bit (RaggedBatch.padded, server side): the update is the same
computation on the same tensors. A batch that is not (a mask with a hole, padding that holds anything but
its fill) has no unpadded form: the client sends it whole, to the unary call, whose checks name the fault.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from rlfabric.core import codec
from rlfabric.core.errors import InvalidArgument
from rlfabric.trainer.batch import FLOATS, POSITION_IDS, ROUTES
from rlfabric.v1 import actor_pb2, tensor_pb2

SEQUENCE_TENSORS = ("input_ids", POSITION_IDS, ROUTES)
RESPONSE_TENSORS = ("response_mask", *FLOATS)
IMPLIED = ("attention_mask", "responses")  # from the lengths and input_ids
CHUNK_BYTES = 4 * 1024 * 1024  # tensor bytes in one RaggedRows, well under any message limit


def fill_of(name: str, dtype: torch.dtype, pad_token_id: int) -> int:
    """What `name` holds on padding: the pad token in input_ids, 255 (uint8) or -1 in routed_experts, else 0."""
    if name == "input_ids":
        return pad_token_id
    if name == ROUTES:
        return 255 if dtype == torch.uint8 else -1
    return 0


# -- client side: a padded batch, unpadded piece by piece ---------------------------------------------


@dataclass
class Unpadded:
    """A padded batch known to be in the unpadded layout, cut into RaggedRows pieces on demand (no second
    copy of the batch: each piece is taken from the padded tensors as it is sent)."""

    tensors: Mapping[str, torch.Tensor]
    prompt_lengths: torch.Tensor  # [B] int64
    response_lengths: torch.Tensor  # [B] int64
    span: torch.Tensor  # [B, P+T] bool, the real tokens
    pad_token_id: int

    @property
    def num_rows(self) -> int:
        return len(self.prompt_lengths)

    def header(self, global_step: int) -> actor_pb2.UpdatePolicyStreamHeader:
        width = self.span.shape[1]
        response_width = self.tensors["responses"].shape[1]
        return actor_pb2.UpdatePolicyStreamHeader(
            global_step=global_step, num_rows=self.num_rows, pad_token_id=self.pad_token_id,
            prompt_width=width - response_width, response_width=response_width)

    def pieces(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tensor_pb2.RaggedRows]:
        """The rows, a RaggedRows per ~chunk_bytes of tensor data (at least one row each)."""
        response_width = self.tensors["responses"].shape[1]
        sent = {name: value for name, value in self.tensors.items() if name not in IMPLIED}
        sequence = [name for name, value in sent.items() if value.shape[1] != response_width]
        per_token = sum(_row_bytes(sent[name]) for name in sequence)  # bytes of one real token's cells
        per_response = sum(_row_bytes(value) for name, value in sent.items() if name not in sequence)
        row_bytes = (self.prompt_lengths + self.response_lengths) * per_token + self.response_lengths * per_response
        piece_of = np.maximum(np.cumsum(row_bytes.numpy()) - 1, 0) // chunk_bytes  # [B] non-decreasing
        bounds = [0, *(np.flatnonzero(np.diff(piece_of)) + 1).tolist(), self.num_rows]
        # numpy's boolean indexing: several times faster than torch's here.
        arrays = {name: value.detach().cpu().numpy() for name, value in sent.items()}
        whole = self.span.numpy()  # [B, P+T]
        for start, end in zip(bounds, bounds[1:], strict=False):
            span = whole[start:end]  # [rows, P+T]
            piece = tensor_pb2.RaggedRows(prompt_lengths=self.prompt_lengths[start:end].tolist(),
                                          response_lengths=self.response_lengths[start:end].tolist())
            for name, array in arrays.items():
                held = piece.sequence if name in sequence else piece.response
                codec.encode_into(held[name], array[start:end][span if name in sequence else span[:, -response_width:]])
            yield piece


def _row_bytes(value: torch.Tensor) -> int:
    """Bytes of one [row, column] cell of a padded tensor (its trailing dimensions included)."""
    return value[0, 0].numel() * value.element_size() if value.numel() else 0


def unpadded(tensors: Mapping[str, torch.Tensor]) -> Unpadded | None:
    """`tensors` as an Unpadded batch, or None when it is not in that layout exactly (module docstring)."""
    ids, mask, responses = (tensors.get(name) for name in ("input_ids", "attention_mask", "responses"))
    if ids is None or mask is None or responses is None or ids.dim() != 2 or responses.dim() != 2:
        return None
    rows, width = ids.shape
    response_width = responses.shape[1]
    if mask.shape != ids.shape or responses.shape[0] != rows or not 0 < response_width < width or rows == 0:
        return None
    prompt_width = width - response_width
    if mask.dtype == torch.bool or int(mask.min()) < 0 or int(mask.max()) > 1:
        return None
    prompt_lengths = mask[:, :prompt_width].sum(1, dtype=torch.int64)  # [B]
    response_lengths = mask[:, prompt_width:].sum(1, dtype=torch.int64)  # [B]
    span = _span(prompt_lengths, response_lengths, prompt_width, response_width)
    if not torch.equal(mask.bool(), span) or not torch.equal(responses, ids[:, prompt_width:]):
        return None
    padding = ~span
    pad_token_id = int(ids.view(-1)[int(padding.view(-1).to(torch.uint8).argmax())]) if padding.any() else 0
    for name, value in tensors.items():
        if name in IMPLIED:
            continue
        if name not in (*SEQUENCE_TENSORS, *RESPONSE_TENSORS) or value.dim() < 2 or value.shape[0] != rows:
            return None
        cells = padding if name in SEQUENCE_TENSORS else padding[:, prompt_width:]
        if value.shape[:2] != cells.shape or not _on_the_wire(value.dtype):
            return None
        fill = fill_of(name, value.dtype, pad_token_id)
        held = value.reshape(*cells.shape, -1) != fill  # [B, columns, cells] true where a cell is not the fill
        if (held & cells.unsqueeze(-1)).any():
            return None
    return Unpadded(tensors, prompt_lengths, response_lengths, span, pad_token_id)


def _on_the_wire(dtype: torch.dtype) -> bool:
    """A dtype the pieces carry: the wire's, but bfloat16 (numpy, which cuts the pieces, has none)."""
    if dtype == torch.bfloat16:
        return False
    try:
        codec.wire_dtype(dtype)
    except InvalidArgument:
        return False
    return True


def _span(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, prompt_width: int,
          response_width: int) -> torch.Tensor:
    """[B, P+T] bool: row i's columns [P - p_i, P + r_i)."""
    columns = torch.arange(prompt_width + response_width)  # [P+T]
    return (columns >= prompt_width - prompt_lengths[:, None]) & (columns < prompt_width + response_lengths[:, None])


# -- server side: the pieces, checked and padded back -------------------------------------------------


@dataclass
class RaggedBatch:
    """A stream's rows, unpadded (module docstring); padded() is the batch the client unpadded."""

    header: actor_pb2.UpdatePolicyStreamHeader
    prompt_lengths: np.ndarray  # [B] int64
    response_lengths: np.ndarray  # [B] int64
    sequence: dict[str, np.ndarray | torch.Tensor] = field(default_factory=dict)  # [sum(p + r), ...]
    response: dict[str, np.ndarray | torch.Tensor] = field(default_factory=dict)  # [sum(r), ...]

    @property
    def num_rows(self) -> int:
        return len(self.prompt_lengths)

    def names(self) -> list[str]:
        """The padded batch's tensors."""
        return [*IMPLIED, *self.sequence, *self.response]

    def num_tokens(self) -> int:
        """Real tokens, prompt and response (SequenceBatch.num_tokens of the padded batch)."""
        return int(self.prompt_lengths.sum() + self.response_lengths.sum())

    def check(self, vocab_size: int, required_floats: tuple[str, ...], optional_floats: tuple[str, ...],
              max_length: int) -> None:
        """validate_batch's checks of the values, on the rows as they came (the simulated trainer's, which never
        pads them); InvalidArgument names the first fault."""
        width = self.header.prompt_width + self.header.response_width
        if width > max_length:
            raise InvalidArgument(f"input_ids has {width} columns but the model takes at most {max_length} positions")
        missing = [name for name in ("response_mask", *required_floats) if name not in self.response]
        if missing:
            raise InvalidArgument(f"batch is missing tensor(s) {missing}")
        ids, mask = torch.as_tensor(self.sequence["input_ids"]), torch.as_tensor(self.response["response_mask"])
        if ids.dim() != 1 or mask.dim() != 1:
            raise InvalidArgument("input_ids and response_mask take one value per token")
        if ((ids < 0) | (ids >= vocab_size)).any():
            raise InvalidArgument(f"input_ids has a token id outside the model's vocabulary [0, {vocab_size})")
        if ((mask != 0) & (mask != 1)).any():
            raise InvalidArgument("response_mask must hold only 0 and 1")
        for name, value in self.response.items():
            value = torch.as_tensor(value)
            if name in FLOATS and name not in (*required_floats, *optional_floats):
                raise InvalidArgument(f"unexpected tensor {name!r} for this call")
            if name in FLOATS and not (value.is_floating_point() and torch.isfinite(value).all()):
                raise InvalidArgument(f"{name} must be finite floats")
        if "rollout_is_weights" in self.response and (torch.as_tensor(self.response["rollout_is_weights"]) < 0).any():
            raise InvalidArgument("rollout_is_weights must be >= 0")

    def padded(self) -> dict[str, torch.Tensor]:
        """The batch in the padded layout [B, P+T] / [B, T], as the client had it."""
        header = self.header
        prompt_width, response_width = header.prompt_width, header.response_width
        span = _span(torch.from_numpy(self.prompt_lengths), torch.from_numpy(self.response_lengths),
                     prompt_width, response_width)
        out = {"attention_mask": span.to(torch.int64)}
        for name, flat in self.sequence.items():
            out[name] = _scattered(name, torch.as_tensor(flat), span, header.pad_token_id)
        out["responses"] = out["input_ids"][:, prompt_width:].clone()
        response_span = span[:, prompt_width:]
        for name, flat in self.response.items():
            out[name] = _scattered(name, torch.as_tensor(flat), response_span, header.pad_token_id)
        return out


def _scattered(name: str, flat: torch.Tensor, cells: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """[B, columns, ...] of `name`'s fill with `flat` [cells.sum(), ...] written into the true `cells` in row order."""
    out = torch.full((*cells.shape, *flat.shape[1:]), fill_of(name, flat.dtype, pad_token_id), dtype=flat.dtype)
    out[cells] = flat
    return out


async def received_batch(requests: AsyncIterator[actor_pb2.ActorServiceUpdatePolicyStreamRequest]) -> RaggedBatch:
    """An UpdatePolicyStream's batch: its header, then its pieces checked against their lengths and each other.
    InvalidArgument names what is wrong (the values themselves are the engine's to check, as in UpdatePolicy)."""
    header, pieces = None, []
    async for request in requests:
        part = request.WhichOneof("part")
        if part == "header" and header is None and not pieces:
            header = request.header
        elif part == "rows" and header is not None:
            pieces.append(_checked_piece(request.rows, len(pieces), pieces[0] if pieces else None))
        else:
            where = "after the header" if header is not None else "before the header"
            raise InvalidArgument(f"UpdatePolicyStream: a {part or 'empty'} message {where}: the stream is one header, "
                                  "then the rows")
    if header is None:
        raise InvalidArgument("UpdatePolicyStream: no header")
    return _batch_of(header, pieces)


@dataclass
class _Piece:
    prompt_lengths: np.ndarray
    response_lengths: np.ndarray
    sequence: dict[str, torch.Tensor]
    response: dict[str, torch.Tensor]


def _checked_piece(rows: tensor_pb2.RaggedRows, index: int, first: _Piece | None) -> _Piece:
    where = f"UpdatePolicyStream rows message {index}"
    prompt_lengths = np.asarray(rows.prompt_lengths, dtype=np.int64)
    response_lengths = np.asarray(rows.response_lengths, dtype=np.int64)
    if len(prompt_lengths) != len(response_lengths) or not len(prompt_lengths):
        raise InvalidArgument(f"{where}: {len(prompt_lengths)} prompt_lengths and {len(response_lengths)} "
                              "response_lengths; one of each per row, at least one row")
    if (prompt_lengths < 0).any() or (response_lengths < 0).any():
        raise InvalidArgument(f"{where}: a negative length")
    piece = _Piece(prompt_lengths, response_lengths, {}, {})
    for kind, messages, names, count in (("sequence", rows.sequence, SEQUENCE_TENSORS,
                                          int(prompt_lengths.sum() + response_lengths.sum())),
                                         ("response", rows.response, RESPONSE_TENSORS, int(response_lengths.sum()))):
        for name, message in messages.items():
            if name not in names:
                raise InvalidArgument(f"{where}: unexpected {kind} tensor {name!r}; expected one of {list(names)}")
            value = codec.to_torch(message, name=f"{where}: {name}")
            if value.dim() == 0 or value.shape[0] != count:
                raise InvalidArgument(f"{where}: {kind} tensor {name} has shape {list(value.shape)}; its rows' "
                                      f"{count} {kind} cells expected first")
            getattr(piece, kind)[name] = value
    for kind in ("sequence", "response"):
        ours = {name: (value.dtype, value.shape[1:]) for name, value in getattr(piece, kind).items()}
        theirs = {name: (value.dtype, value.shape[1:]) for name, value in getattr(first or piece, kind).items()}
        if ours != theirs:
            raise InvalidArgument(f"{where}: {kind} tensors {ours} differ from the first message's {theirs}")
    if "input_ids" not in piece.sequence:
        raise InvalidArgument(f"{where}: no input_ids")
    return piece


def _batch_of(header: actor_pb2.UpdatePolicyStreamHeader, pieces: list[_Piece]) -> RaggedBatch:
    prompt_lengths = np.concatenate([p.prompt_lengths for p in pieces]) if pieces else np.zeros(0, np.int64)
    response_lengths = np.concatenate([p.response_lengths for p in pieces]) if pieces else np.zeros(0, np.int64)
    if len(prompt_lengths) != header.num_rows or not header.num_rows:
        raise InvalidArgument(f"UpdatePolicyStream: {len(prompt_lengths)} rows sent, the header says {header.num_rows}")
    if header.response_width < 1 or header.prompt_width < 1:
        raise InvalidArgument(f"UpdatePolicyStream: prompt_width {header.prompt_width} and response_width "
                              f"{header.response_width}; at least 1 each")
    if prompt_lengths.max() > header.prompt_width or response_lengths.max() > header.response_width:
        raise InvalidArgument(f"UpdatePolicyStream: a row of {int(prompt_lengths.max())} prompt and "
                              f"{int(response_lengths.max())} response tokens does not fit the header's widths "
                              f"{header.prompt_width} and {header.response_width}")
    batch = RaggedBatch(header, prompt_lengths, response_lengths)
    for kind in ("sequence", "response"):
        for name in getattr(pieces[0], kind):
            getattr(batch, kind)[name] = torch.cat([getattr(p, kind)[name] for p in pieces])
    return batch
