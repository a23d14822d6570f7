"""The batch layout of the actor, reference and critic services (VeRL's names), validated into torch
tensors, and how one rank cuts its rows into micro-batches.

    input_ids      [B, S] int64    left-padded prompt followed by right-padded response
    attention_mask [B, S] int64    1 = real token
    position_ids   [B, S] int64    derived from attention_mask when absent
    responses      [B, T] int64    == input_ids[:, -T:]
    response_mask  [B, T] int64    1 = real response token
    old_log_probs, advantages, ref_log_probs, values, returns: [B, T] float32, per response token
    rollout_is_weights [B, T] float32 >= 0   rollout correction's IS weights of the policy loss
    routed_experts [B, S, layers, top_k] uint8 (255 = none) or int32/int64 (-1 = none)   MoE routing replay:
                   the experts the rollout chose for each token (actor.router_replay; core.router_replay)

Padding: a micro-batch drops the columns that are padding in all its rows (prompt padding on the left,
response padding on the right) before the forward pass; the causal model gives the same numbers for
the remaining positions, and every loss is masked by response_mask, so padding never enters the math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfabric.core.errors import InvalidArgument

SEQUENCE = ("input_ids", "attention_mask", "responses", "response_mask")
POSITION_IDS = "position_ids"
FLOATS = ("old_log_probs", "advantages", "ref_log_probs", "values", "returns", "rollout_is_weights")
ROUTES = "routed_experts"
TENSOR_NAMES = (*SEQUENCE, POSITION_IDS, *FLOATS, ROUTES)
_ROUTE_TYPES = (torch.uint8, torch.int32, torch.int64)
_INTEGER = (torch.int64, torch.int32)
_MASK = (torch.int64, torch.int32, torch.uint8, torch.bool)


@dataclass
class SequenceBatch:
    """A validated batch: int64 ids/masks/positions and float32 per-token tensors, all with B rows."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def num_rows(self) -> int:
        return self.tensors["input_ids"].shape[0]

    @property
    def response_len(self) -> int:
        return self.tensors["responses"].shape[1]

    def select(self, rows: torch.Tensor | slice) -> SequenceBatch:
        return SequenceBatch({name: t[rows] for name, t in self.tensors.items()})

    def to(self, device: torch.device) -> SequenceBatch:
        return SequenceBatch({name: t.to(device, non_blocking=True) for name, t in self.tensors.items()})

    def num_tokens(self) -> int:
        """Real (unpadded) tokens, prompt and response."""
        return int(self.tensors["attention_mask"].sum())


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, as the rollout's generate() numbers them: [B, S]."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def validate_batch(
    tensors: dict[str, torch.Tensor],
    vocab_size: int,
    required_floats: tuple[str, ...] = (),
    optional_floats: tuple[str, ...] = (),
    max_length: int | None = None,
) -> SequenceBatch:
    """Checks the layout above and returns owned, normalised tensors; InvalidArgument names the problem.

    `tensors` come from codec.decode_batch, which has already checked byte lengths, presence of the
    names it was given and the common row count.
    """
    for name in (*SEQUENCE, *required_floats):
        if name not in tensors:
            raise InvalidArgument(f"batch is missing tensor {name!r}")
    routes = tensors.get(ROUTES)
    tensors = {name: value for name, value in tensors.items() if name != ROUTES}
    for name, value in tensors.items():
        if value.dim() != 2:
            raise InvalidArgument(f"{name} must be 2-D [batch, length], got shape {list(value.shape)}")
    ids, responses = tensors["input_ids"], tensors["responses"]
    rows, seq_len = ids.shape
    response_len = responses.shape[1]
    if rows == 0:
        raise InvalidArgument("batch is empty (0 rows)")
    if response_len == 0:
        raise InvalidArgument("responses has 0 columns; at least one response token is needed")
    if max_length is not None and seq_len > max_length:
        raise InvalidArgument(f"input_ids has {seq_len} columns but the model takes at most {max_length} positions "
                              "(max_position_embeddings)")
    if response_len >= seq_len:
        raise InvalidArgument(
            f"responses has {response_len} columns but input_ids only {seq_len}: input_ids must hold at "
            "least one prompt token before the response (it predicts the first response token)"
        )
    _check_shape(tensors, "attention_mask", ids.shape, "input_ids")
    _check_shape(tensors, POSITION_IDS, ids.shape, "input_ids")
    _check_shape(tensors, "response_mask", responses.shape, "responses")
    out: dict[str, torch.Tensor] = {}
    for name in ("input_ids", "responses", POSITION_IDS):
        if name in tensors:
            out[name] = _as_int64(tensors[name], name, _INTEGER)
    for name in ("attention_mask", "response_mask"):
        out[name] = _as_int64(tensors[name], name, _MASK)
        if ((out[name] != 0) & (out[name] != 1)).any():
            raise InvalidArgument(f"{name} must hold only 0 and 1")
    for name in ("input_ids", "responses"):
        bad = (out[name] < 0) | (out[name] >= vocab_size)
        if bad.any():
            row, col = (int(i) for i in bad.nonzero()[0])
            raise InvalidArgument(
                f"{name} has token id {int(out[name][row, col])} at row {row}, column {col}, outside the "
                f"model's vocabulary [0, {vocab_size})"
            )
    if not torch.equal(out["responses"], out["input_ids"][:, -response_len:]):
        raise InvalidArgument(f"responses must equal the last {response_len} columns of input_ids")
    if (out["response_mask"] > out["attention_mask"][:, -response_len:]).any():
        raise InvalidArgument("response_mask marks a token that attention_mask marks as padding")
    for name in FLOATS:
        if name not in tensors:
            continue
        if name not in required_floats and name not in optional_floats:
            raise InvalidArgument(f"unexpected tensor {name!r} for this call")
        _check_shape(tensors, name, responses.shape, "responses")
        value = tensors[name]
        if not value.is_floating_point():
            raise InvalidArgument(f"{name} must be a float tensor, got {value.dtype}")
        value = value.to(torch.float32, copy=True)
        finite = torch.isfinite(value)
        if not finite.all():
            row, col = (int(i) for i in (~finite).nonzero()[0])
            raise InvalidArgument(
                f"{name} has {int((~finite).sum())} NaN/inf value(s), the first at row {row}, column {col}"
            )
        out[name] = value
    if "rollout_is_weights" in out and (out["rollout_is_weights"] < 0).any():
        raise InvalidArgument("rollout_is_weights must be >= 0: a negative weight would turn a token's gradient around")
    if POSITION_IDS not in out:
        out[POSITION_IDS] = position_ids_from_mask(out["attention_mask"])
    if routes is not None:
        out[ROUTES] = _checked_routes(routes, ids.shape)
    return SequenceBatch(out)


def _checked_routes(routes: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """routed_experts as int64 [B, S, layers, top_k] with -1 where a token has none."""
    if routes.dim() != 4 or routes.shape[:2] != shape:
        raise InvalidArgument(f"{ROUTES} has shape {list(routes.shape)}; [batch, length, layers, top_k] with "
                              f"[batch, length] = {list(shape)} (input_ids) expected")
    if routes.dtype not in _ROUTE_TYPES:
        kinds = ", ".join(str(d).removeprefix("torch.") for d in _ROUTE_TYPES)
        raise InvalidArgument(f"{ROUTES} must be one of {kinds}, got {str(routes.dtype).removeprefix('torch.')}")
    wide = routes.to(torch.int64, copy=True)
    if routes.dtype == torch.uint8:
        wide[wide == 255] = -1
    if (wide < -1).any():
        raise InvalidArgument(f"{ROUTES} holds a negative expert id other than -1 (none)")
    return wide


def _check_shape(tensors: dict[str, torch.Tensor], name: str, shape: torch.Size, like: str) -> None:
    if name in tensors and tensors[name].shape != shape:
        raise InvalidArgument(f"{name} has shape {list(tensors[name].shape)} but {like} has {list(shape)}")


def _as_int64(value: torch.Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> torch.Tensor:
    if value.dtype not in allowed:
        kinds = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise InvalidArgument(f"{name} must be one of {kinds}, got {str(value.dtype).removeprefix('torch.')}")
    return value.to(torch.int64, copy=True)  # owned memory, not a view of the request bytes


def padding_batch(float_names: tuple[str, ...] = ()) -> SequenceBatch:
    """One row with no response token: what a rank runs when it has fewer micro-batches than its peers
    (every FSDP2 rank must take part in every forward/backward). It adds nothing to any loss."""
    ones = torch.ones(1, 2, dtype=torch.int64)
    tensors = {
        "input_ids": torch.zeros(1, 2, dtype=torch.int64),
        "attention_mask": ones,
        POSITION_IDS: torch.tensor([[0, 1]]),
        "responses": torch.zeros(1, 1, dtype=torch.int64),
        "response_mask": torch.zeros(1, 1, dtype=torch.int64),
    }
    tensors.update({name: torch.zeros(1, 1) for name in float_names})
    return SequenceBatch(tensors)


def trim_padding(batch: SequenceBatch) -> SequenceBatch:
    """Drops the columns that are padding in every row: left of the earliest real token and right of
    the latest real response token. Keeps at least one prompt column and one response column."""
    seq_len, response_len = batch["input_ids"].shape[1], batch.response_len
    real_columns = batch["attention_mask"].any(dim=0).nonzero()
    first = int(real_columns[0]) if len(real_columns) else 0
    first = min(first, seq_len - response_len - 1)
    response_columns = batch["response_mask"].any(dim=0).nonzero()
    kept_response = int(response_columns[-1]) + 1 if len(response_columns) else 1
    cut_right = response_len - kept_response
    if first == 0 and cut_right == 0:
        return batch
    trimmed = {}
    for name, value in batch.tensors.items():
        if value.shape[1] == seq_len:
            trimmed[name] = value[:, first : seq_len - cut_right]
        else:
            trimmed[name] = value[:, :kept_response]
    return SequenceBatch(trimmed)


def pad_columns(value: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pads a [rows, t] per-token output with zeros to [rows, length]."""
    return torch.nn.functional.pad(value, (0, length - value.shape[1]))


def plan_micro_batches(batch: SequenceBatch, max_rows: int, max_tokens: int) -> list[torch.Tensor]:
    """Row indices of each micro-batch.

    max_tokens == 0: consecutive groups of max_rows rows. Otherwise a token budget: rows sorted by
    length, longest first, then packed greedily while rows x longest length (the padded size after
    trim_padding, roughly) stays within max_tokens. A row longer than the budget goes alone.
    """
    rows = batch.num_rows
    if max_tokens <= 0:
        return [torch.arange(start, min(start + max_rows, rows)) for start in range(0, rows, max_rows)]
    lengths = batch["attention_mask"].sum(dim=1)  # [rows]
    order = torch.argsort(lengths, descending=True, stable=True)
    groups: list[list[int]] = []
    longest = 0
    for index in order.tolist():
        length = int(lengths[index])
        if groups and (len(groups[-1]) + 1) * longest <= max_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
            longest = length
    return [torch.tensor(sorted(group)) for group in groups]


def equalize_micro_batches(plan: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """Splits the largest micro-batches (or adds empty ones) until there are `count` of them, so that
    every rank runs the same number of forward passes."""
    plan = list(plan)
    while len(plan) < count:
        largest = max(range(len(plan)), key=lambda i: len(plan[i]), default=None)
        if largest is None or len(plan[largest]) < 2:
            plan.append(torch.empty(0, dtype=torch.int64))
            continue
        rows = plan.pop(largest)
        half = (len(rows) + 1) // 2
        plan[largest:largest] = [rows[:half], rows[half:]]
    return plan


def shard_rows(num_rows: int, world_size: int, mini_batch_rows: int | None = None) -> list[torch.Tensor]:
    """Row indices each rank gets.

    Inference (mini_batch_rows None): contiguous, near-equal blocks. Training: every mini-batch is cut
    into world_size equal blocks, so rank r's k-th local mini-batch is its block of global mini-batch k.
    """
    if mini_batch_rows is None:
        return list(torch.arange(num_rows).tensor_split(world_size))
    per_rank = mini_batch_rows // world_size
    starts = torch.arange(0, num_rows, mini_batch_rows)  # [num_mini]
    offsets = torch.arange(per_rank)  # [per_rank]
    return [(starts[:, None] + rank * per_rank + offsets[None, :]).reshape(-1) for rank in range(world_size)]
