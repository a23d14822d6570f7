"""Per-token log-probs and entropy from LM logits, without a float32 copy of the whole logits.

Why: a micro-batch's logits are the largest tensor of an update (32 rows x 257 positions x 49k vocab is
0.8 GB in bf16). Upcasting them to float32, dividing by the temperature and keeping the results for the
backward pass, as the obvious code does, holds several full-vocabulary float32 copies at once.

Here one autograd function walks the logits in blocks of rows. The forward pass upcasts one block, divides
it by the temperature and reduces it to logsumexp, the label's log-prob and (when asked) the entropy; it
keeps only the logits it was given (no copy) and the per-token results. The backward pass recomputes each
block's softmax and writes that block's gradient straight into one buffer shaped like the logits (in their
dtype), so the extra memory of either pass is one block, whatever the length of the batch.

Math (z = logits / T, p = softmax(z), lse = logsumexp(z)):
    log_prob = z[label] - lse
    entropy  = -sum(p * log p)                      (= lse - sum(p * z), VeRL's form; this one does not
                                                     cancel two large terms in float32)
    sum_pi_squared = sum(p^2)                       (the optimal token baselines' input; no gradient)
    d log_prob / dz = onehot(label) - p
    d entropy  / dz = -p * (log p + entropy)
and d/dlogits = d/dz / T.
"""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 24  # float32 elements of one block (64 MB): a few such temporaries exist per block


def _block_rows(vocab: int, chunk_size: int | None) -> int:
    """Rows (tokens) per block: chunk_size, or as many as fit BLOCK_ELEMENTS."""
    if chunk_size is not None:
        return chunk_size
    return max(1, BLOCK_ELEMENTS // max(vocab, 1))


def _blocks(rows: int, positions: int, block_rows: int):
    """(row slice, position slice) blocks covering [rows, positions], about block_rows tokens each."""
    if rows == 0 or positions == 0:
        return
    per_block = min(positions, block_rows)
    batch_rows = max(1, block_rows // max(positions, 1))
    for row in range(0, rows, batch_rows):
        for position in range(0, positions, per_block):
            yield slice(row, row + batch_rows), slice(position, position + per_block)


def _scaled(block: torch.Tensor, temperature: float) -> torch.Tensor:
    """A float32 (or float64) copy of block / T; bf16/fp16 are upcast (a float32 input at T = 1 is not copied)."""
    block = block.to(torch.promote_types(block.dtype, torch.float32))
    return block / temperature if temperature != 1.0 else block


class _LogProbsAndEntropy(torch.autograd.Function):
    """logits [B, L, V] -> log_probs [B, T], entropy [B, T] or None, read at positions start .. start+T-1."""

    @staticmethod
    def forward(ctx, logits, labels, start, temperature, with_entropy, block_rows):
        ctx.set_materialize_grads(False)  # an entropy that only feeds a metric sends no gradient
        rows, positions = labels.shape
        window = logits[:, start : start + positions]  # [B, T, V], a view
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        log_probs = torch.empty(rows, positions, dtype=out_dtype, device=logits.device)
        lse = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        for r, t in _blocks(rows, positions, block_rows):
            z = _scaled(window[r, t], temperature)  # [b, t, V]
            lse[r, t] = torch.logsumexp(z, dim=-1)
            log_probs[r, t] = z.gather(-1, labels[r, t].unsqueeze(-1)).squeeze(-1) - lse[r, t]
            if with_entropy:
                log_p = z - lse[r, t].unsqueeze(-1)
                entropy[r, t] = -log_p.exp().mul_(log_p).sum(dim=-1)
        ctx.save_for_backward(logits, labels, lse, entropy if with_entropy else lse)
        ctx.start, ctx.temperature, ctx.block_rows = start, temperature, block_rows
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if grad_log_probs is None and grad_entropy is None:
            return None, None, None, None, None, None
        rows, positions = labels.shape
        start, temperature = ctx.start, ctx.temperature
        grad = torch.empty_like(logits)  # [B, L, V]; positions outside the window get no gradient
        grad[:, :start].zero_()
        grad[:, start + positions :].zero_()
        window = grad[:, start : start + positions]
        for r, t in _blocks(rows, positions, ctx.block_rows):
            z = _scaled(logits[:, start : start + positions][r, t], temperature)  # [b, t, V]
            log_p = z - lse[r, t].unsqueeze(-1)  # a new tensor: z may be a view of the logits
            p = log_p.exp()
            # d/dz = onehot * g_lp - p * (g_lp + g_ent * (log p + entropy)), built in place
            if grad_entropy is None:
                block = p.mul_(grad_log_probs[r, t].unsqueeze(-1)).neg_()
            else:
                weight = log_p.add_(entropy[r, t].unsqueeze(-1)).mul_(grad_entropy[r, t].unsqueeze(-1))
                if grad_log_probs is not None:
                    weight.add_(grad_log_probs[r, t].unsqueeze(-1))
                block = weight.mul_(p).neg_()
            if grad_log_probs is not None:
                block.scatter_add_(-1, labels[r, t].unsqueeze(-1), grad_log_probs[r, t].unsqueeze(-1).to(block.dtype))
            if temperature != 1.0:
                block.div_(temperature)
            window[r, t] = block
        return grad, None, None, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    start: int | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[label] and the entropy of softmax(logits / T), per token, in one pass.

    logits [B, L, vocab] (any float dtype), labels [B, T] token ids; position start + t of the logits
    predicts labels[:, t] (start defaults to L - T: the last T positions). Returns two [B, T] tensors of at
    least float32 (entropy None unless with_entropy). Differentiable in both outputs; only the logits are
    kept for backward. chunk_size: tokens per block (default: about BLOCK_ELEMENTS / vocab).
    """
    fn = "log_probs_and_entropy"
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[0] != labels.shape[0]:
        raise ValueError(f"{fn}: need logits [B, L, vocab] and labels [B, T], got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    start = logits.shape[1] - labels.shape[1] if start is None else start
    if start < 0 or start + labels.shape[1] > logits.shape[1]:
        raise ValueError(f"{fn}: positions {start}..{start + labels.shape[1] - 1} are outside the "
                         f"{logits.shape[1]} positions of the logits")
    if labels.is_floating_point() or (chunk_size is not None and chunk_size < 1) or not temperature > 0:
        raise ValueError(f"{fn}: labels must be integer token ids, chunk_size >= 1 and temperature > 0")
    block_rows = _block_rows(logits.shape[-1], chunk_size)
    return _LogProbsAndEntropy.apply(logits, labels.long(), start, float(temperature), with_entropy, block_rows)


@torch.no_grad()
def sum_pi_squared_from_logits(logits: torch.Tensor, positions: int, temperature: float = 1.0, start: int | None = None,
                               chunk_size: int | None = None) -> torch.Tensor:
    """sum over the vocabulary of softmax(logits / T)^2 at positions start .. start+positions-1: logits
    [B, L, vocab] -> [B, positions] (>= float32), one block at a time, without a gradient. start defaults to
    L - positions, as log_probs_and_entropy's."""
    start = logits.shape[1] - positions if start is None else start
    if logits.dim() != 3 or start < 0 or start + positions > logits.shape[1] or not temperature > 0:
        raise ValueError(f"sum_pi_squared_from_logits: need logits [B, L, vocab] holding positions {start}.."
                         f"{start + positions - 1} and temperature > 0, got {tuple(logits.shape)}, T={temperature}")
    rows = logits.shape[0]
    window = logits[:, start : start + positions]  # [B, T, V], a view
    out = torch.empty(rows, positions, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    for r, t in _blocks(rows, positions, _block_rows(logits.shape[-1], chunk_size)):
        out[r, t] = torch.softmax(_scaled(window[r, t], temperature), dim=-1).square_().sum(dim=-1)
    return out


def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [1, rows, vocab] (a view where the layout allows)."""
    if logits.dim() < 1:
        raise ValueError(f"need logits [..., vocab], got shape {tuple(logits.shape)}")
    return logits.reshape(1, -1, logits.shape[-1])


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T)[label], per position: logits [..., vocab], labels [...] -> [...] (>= float32)."""
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"log_probs_from_logits: labels shape {tuple(labels.shape)} does not match "
                         f"logits shape {tuple(logits.shape)} without its vocab dim")
    log_probs, _ = log_probs_and_entropy(_as_rows(logits), labels.reshape(1, -1), temperature, False,
                                         chunk_size=chunk_size)
    return log_probs.reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the last dim: logits [..., vocab] -> [...] (>= float32)."""
    rows = _as_rows(logits)
    labels = torch.zeros(rows.shape[:2], dtype=torch.long, device=logits.device)  # any id: log-probs unused
    _, entropy = log_probs_and_entropy(rows, labels, temperature, True, chunk_size=chunk_size)
    return entropy.reshape(logits.shape[:-1])
