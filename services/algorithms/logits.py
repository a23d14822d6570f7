"""Per-token log-probs and entropy from LM logits [..., vocab], without keeping a full softmax copy.

Why chunks: logits of a batch are often several GB (e.g. 8 x 4096 x 150k vocab in bf16 is ~10 GB), and
a float32 softmax of the whole thing would be twice that again. We upcast and reduce `chunk_size` rows
at a time, so the extra forward memory is one chunk x vocab. Log-probs use logsumexp + gather, whose
backward recomputes the softmax from the logits instead of storing it; entropy needs the softmax, and
under autograd each chunk's copy is kept for the backward pass (the saving there is in the no-grad
metrics path).
"""

import torch

CHUNK_SIZE = 1024


def _upcast(x: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 -> float32 for the reductions; float32/float64 stay as they are
    return x.to(torch.promote_types(x.dtype, torch.float32))


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(l) - sum(softmax(l) * l).

    logits [..., vocab] -> [...] (at least float32).
    """
    if logits.dim() < 1 or chunk_size < 1:
        raise ValueError(f"entropy_from_logits: need logits [..., vocab] and chunk_size >= 1, "
                         f"got shape {tuple(logits.shape)}, chunk_size {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])  # [rows, vocab]
    chunks = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = _upcast(flat[start:start + chunk_size])  # [chunk, vocab]
        probs = torch.softmax(chunk, dim=-1)
        chunks.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))  # [chunk]
    out = torch.cat(chunks) if chunks else _upcast(flat.new_zeros(0))
    return out.reshape(logits.shape[:-1])


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = CHUNK_SIZE
) -> torch.Tensor:
    """log softmax(logits)[label] = logits[label] - logsumexp(logits), per position.

    logits [..., vocab], labels [...] (integer token ids) -> [...] (at least float32).
    """
    fn = "log_probs_from_logits"
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{fn}: labels shape {tuple(labels.shape)} does not match "
                         f"logits shape {tuple(logits.shape)} without its vocab dim")
    if labels.is_floating_point() or chunk_size < 1:
        raise ValueError(f"{fn}: labels must be integer token ids and chunk_size >= 1")
    flat = logits.reshape(-1, logits.shape[-1])  # [rows, vocab]
    flat_labels = labels.reshape(-1, 1).long()  # [rows, 1]
    chunks = []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = _upcast(flat[start:start + chunk_size])  # [chunk, vocab]
        picked = chunk.gather(-1, flat_labels[start:start + chunk_size]).squeeze(-1)  # [chunk]
        chunks.append(picked - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(chunks) if chunks else _upcast(flat.new_zeros(0))
    return out.reshape(labels.shape)
