"""What one micro-batch contributes: the forward passes (log-probs, values) and the PPO losses.

A mini-batch's loss is spread over ranks and micro-batches. Each micro-batch normalises by the
mini-batch's global counts (tokens, sequences over all ranks), so the sum of the micro-batch losses
over every rank equals the single-process loss of the whole mini-batch (shared/reference/algorithms.md,
"across ranks divide by the global token count"). Stats are returned the same way: as contributions
that sum to the mini-batch value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlfabric import algorithms as algos
from rlfabric.core.config import ActorConfig, CriticConfig
from rlfabric.core.dtypes import at_least_float32
from rlfabric.trainer.batch import ROUTES, SequenceBatch


@dataclass
class MiniBatchCounts:
    """Totals of one mini-batch over all ranks, for loss normalisation."""

    tokens: float  # response tokens
    sequences: float  # rows with at least one response token
    response_len: int  # padded response length (seq-mean-token-sum-norm's default scale)

    def aggregation(self) -> dict:
        return dict(global_token_count=self.tokens, global_seq_count=max(self.sequences, 1.0),
                    scale_factor=float(self.response_len))


def _model_inputs(batch: SequenceBatch) -> dict:
    return dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)


def _packing(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where the micro-batch's real tokens go when packed into rows as long as its longest sequence:
    sequences placed first-fit, longest first. The flat position in the packed rows of each real token [B, S]
    (0 at padding), how many tokens each row holds [rows], and the rows' length."""
    real = batch["attention_mask"].bool()
    lengths = real.sum(1).tolist()
    capacity = max(lengths)
    rows: list[list[int]] = []  # the sequences of each packed row
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if fits is None:
            rows.append([])
            room.append(capacity)
            fits = len(rows) - 1
        rows[fits].append(index)
        room[fits] -= lengths[index]
    device = real.device
    where = torch.zeros(real.shape, dtype=torch.long, device=device)
    for row, members in enumerate(rows):
        offset = 0
        for index in members:
            where[index, real[index]] = row * capacity + offset + torch.arange(lengths[index], device=device)
            offset += lengths[index]
    used = torch.tensor([capacity - free for free in room], device=device)
    return where, used, capacity


def _packed_inputs(batch: SequenceBatch) -> tuple[dict, torch.Tensor]:
    """The micro-batch's real tokens packed into rows as long as its longest sequence (sequence packing,
    VeRL's use_remove_padding; _packing places them), each row's tail one more dummy sequence.
    input_ids and position_ids [rows, longest], the positions restarting at 0 for each sequence,
    and no attention mask, so transformers keeps each sequence to itself by its positions (sdpa, eager) or
    takes its variable-length path (flash attention); use_cache=False, or sdpa would attend across them.
    One row of every token would cost attention over all of them at once (quadratic in the micro-batch's
    tokens); rows as long as the longest sequence cost at most what the padded batch does. Also where each
    response token's predicting position lies in the packed rows, flattened: [B, T], 0 where it is padding
    (the response mask drops those)."""
    where, used, capacity = _packing(batch)
    real = batch["attention_mask"].bool()
    device = real.device
    input_ids = torch.zeros(len(used), capacity, dtype=batch["input_ids"].dtype, device=device)
    # the tails' positions count from 0 at each row's end: their own sequence
    position_ids = (torch.arange(capacity, device=device) - used[:, None]).to(batch["position_ids"].dtype)
    input_ids.view(-1)[where[real]] = batch["input_ids"][real]
    position_ids.view(-1)[where[real]] = batch["position_ids"][real]
    inputs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
    return inputs, where[:, -batch.response_len - 1 : -1]


def packed_routes(batch: SequenceBatch) -> torch.Tensor:
    """The batch's routed_experts [B, S, layers, top_k] in the packed rows' token order, flattened:
    [rows * longest, layers, top_k], -1 on the rows' tails (routing replay under sequence packing)."""
    where, used, capacity = _packing(batch)
    real = batch["attention_mask"].bool()
    routes = batch[ROUTES]
    packed = routes.new_full((len(used) * capacity, *routes.shape[2:]), -1)
    packed[where[real]] = routes[real]
    return packed


def shared_prompts(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """When consecutive rows share their prompt (ids, mask and positions; GRPO's group): the first row of each
    distinct prompt [G] and each row's prompt among them [B]. None when no two neighbours share one."""
    prompt_len = batch["input_ids"].shape[1] - batch.response_len
    same = torch.ones(batch.num_rows - 1, dtype=torch.bool, device=batch["input_ids"].device)
    for name in ("input_ids", "attention_mask", "position_ids"):
        prompt = batch[name][:, :prompt_len]
        same &= (prompt[1:] == prompt[:-1]).all(1)
    if not bool(same.any()):
        return None
    starts = torch.cat([same.new_ones(1), ~same])
    return starts.nonzero().squeeze(1), starts.cumsum(0) - 1


def _logits_over_shared_prompts(model: nn.Module, batch: SequenceBatch, first_rows: torch.Tensor,
                                prompt_of_row: torch.Tensor) -> torch.Tensor:
    """The logits that predict each response token [B, T, vocab], with each distinct prompt through the model
    once: its forward pass keeps its keys and values, which each row's response then attends to (an index
    select, so the gradient of every row flows back into its prompt's pass)."""
    response_len = batch.response_len
    prompt_len = batch["input_ids"].shape[1] - response_len
    ids, mask, positions = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    prompts = model(input_ids=ids[first_rows, :prompt_len], attention_mask=mask[first_rows, :prompt_len],
                    position_ids=positions[first_rows, :prompt_len], use_cache=True, logits_to_keep=1)
    if prompts.past_key_values is None:
        raise RuntimeError("the model returned no key/value cache for the shared prompts (gradient checkpointing "
                           "turns it off while training): set share_prompt_forward=false")
    logits = [prompts.logits[prompt_of_row]]  # the last prompt position predicts the first response token
    if response_len > 1:  # the response's tokens but its last predict the rest
        cache = prompts.past_key_values
        cache.batch_select_indices(prompt_of_row)
        responses = model(input_ids=ids[:, prompt_len:-1], attention_mask=mask[:, :-1],
                          position_ids=positions[:, prompt_len:-1], past_key_values=cache, use_cache=True)
        logits.append(responses.logits)
    return torch.cat(logits, dim=1)


def forward_log_probs(
    model: nn.Module, batch: SequenceBatch, temperature: float, with_entropy: bool, keep_logits: bool,
    router_aux_loss: bool = False, packed: bool = False, share_prompts: bool = False,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """log p(response token) [B, T] and, optionally, the entropy of each predicting distribution [B, T],
    both under softmax(logits / temperature), as the rollout's sampler draws; with router_aux_loss (a
    mixture-of-experts model), also its routers' load-balancing loss over the batch's non-padding tokens
    (transformers' aux_loss), else None; with with_sum_pi_squared, sum_v p(v)^2 of each predicting
    distribution [B, T] (no gradient; the optimal token baselines'), else None.

    Position t of the sequence predicts token t + 1, so the response's T tokens are predicted from
    positions S-T-1 .. S-2 (with logits_to_keep, the first T of the T+1 kept). The logits stay in the
    model's dtype; log_probs_and_entropy upcasts one block at a time and keeps no float32 copy.
    packed: the real tokens go through the model packed into rows (_packed_inputs); the log-probs and
    entropies of the packed positions are gathered back into [B, T].
    share_prompts: on the padded path, rows that share their prompt send it through the model once
    (shared_prompts; the same numbers); not with router_aux_loss, whose batch statistics would change.
    """
    response_len = batch.response_len
    extra = {"output_router_logits": True} if router_aux_loss else {}
    if packed:
        # Only the positions that predict a response token go through the LM head, as logits_to_keep does on
        # the padded path: over every packed prompt token the head and its log-softmax would cost more than
        # packing saves. logits_to_keep takes one index list for all rows, so a pre-hook on the head (first,
        # before FSDP's or tensor parallelism's own) hands it the kept positions of every row, [1, N, hidden].
        inputs, predicting = _packed_inputs(batch)
        real = batch["response_mask"].bool()
        kept = predicting[real]

        def keep_response_positions(_head, args):
            return (args[0].flatten(0, 1)[kept].unsqueeze(0), *args[1:])

        hook = model.get_output_embeddings().register_forward_pre_hook(keep_response_positions, prepend=True)
        try:
            output = model(**inputs, **extra)
        finally:
            hook.remove()
        kept_log_probs, kept_entropy = algos.log_probs_and_entropy(
            output.logits, batch["responses"][real].unsqueeze(0), temperature, with_entropy, start=0)
        kept_squares = _sum_pi_squared(output.logits, kept.numel(), temperature, 0, with_sum_pi_squared)

        def unpacked(kept_values: torch.Tensor | None) -> torch.Tensor | None:  # [1, N] -> [B, T], 0 at padding
            return None if kept_values is None else kept_values.new_zeros(real.shape).masked_scatter(real, kept_values[0])

        return (unpacked(kept_log_probs), unpacked(kept_entropy), output.aux_loss if router_aux_loss else None,
                unpacked(kept_squares))
    # Not with replayed routes either: they follow the batch's [B, S] tokens, one forward pass.
    share_prompts = share_prompts and keep_logits and not router_aux_loss and ROUTES not in batch
    shared = shared_prompts(batch) if share_prompts else None
    if shared is not None:
        logits = _logits_over_shared_prompts(model, batch, *shared)
        log_probs, entropy = algos.log_probs_and_entropy(logits, batch["responses"], temperature, with_entropy,
                                                         start=0)
        return log_probs, entropy, None, _sum_pi_squared(logits, response_len, temperature, 0, with_sum_pi_squared)
    if keep_logits:
        extra["logits_to_keep"] = response_len + 1
    output = model(**_model_inputs(batch), **extra)
    logits = output.logits  # [B, S or T+1, vocab]
    start = logits.shape[1] - response_len - 1
    log_probs, entropy = algos.log_probs_and_entropy(logits, batch["responses"], temperature, with_entropy,
                                                     start=start)
    return (log_probs, entropy, output.aux_loss if router_aux_loss else None,
            _sum_pi_squared(logits, response_len, temperature, start, with_sum_pi_squared))


def _sum_pi_squared(logits: torch.Tensor, positions: int, temperature: float, start: int,
                    wanted: bool) -> torch.Tensor | None:
    return algos.sum_pi_squared_from_logits(logits, positions, temperature, start) if wanted else None


def forward_values(model: nn.Module, batch: SequenceBatch, packed: bool = False) -> torch.Tensor:
    """The value of the state before each response token (the head's output one position earlier): [B, T].
    packed: the real tokens packed into rows (_packed_inputs). At least float32 (float64 under a float64 model)."""
    if packed:
        inputs, predicting = _packed_inputs(batch)
        values = model(**inputs).logits.flatten(0, 1)[predicting, 0]
    else:
        values = model(**_model_inputs(batch)).logits[:, -batch.response_len - 1 : -1, 0]  # [B, T]
    return values.to(at_least_float32(values.dtype))


def _token_weight(stat: torch.Tensor, mask: torch.Tensor, counts: MiniBatchCounts) -> torch.Tensor:
    """A masked mean over this micro-batch, weighted by its share of the mini-batch's tokens."""
    return stat * mask.sum() / max(counts.tokens, 1.0)


class PolicyObjective:
    """PPO policy loss (+ optional KL loss and entropy bonus) of the actor."""

    float_names = ("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights")

    def __init__(self, config: ActorConfig, temperature: float, keep_logits: bool, share_prompts: bool = False,
                 sections: dict | None = None):
        self.config = config
        self.sections = sections or {}  # algos.POLICY_LOSS_SECTIONS by name (bypass_mode's rollout correction)
        self.temperature = temperature
        self.keep_logits = keep_logits
        self.share_prompts = share_prompts

    def required_floats(self) -> tuple[str, ...]:
        """old_log_probs may be left out when the update is a single optimizer step (see loss)."""
        return ("advantages", "ref_log_probs") if self.config.use_kl_loss else ("advantages",)

    def loss(
        self, model: nn.Module, batch: SequenceBatch, counts: MiniBatchCounts
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        mask = batch["response_mask"].float()  # [B, T]
        want_entropy_grad = cfg.entropy_coeff != 0
        # The entropy comes from the same pass over the logits as the log-probs (the actor/entropy metric
        # reads it); it sends a gradient only with an entropy bonus.
        router_coef = cfg.router_aux_loss_coef
        log_probs, entropy, router_loss, _ = forward_log_probs(model, batch, self.temperature, True, self.keep_logits,
                                                            router_aux_loss=router_coef > 0, packed=cfg.use_remove_padding,
                                                            share_prompts=self.share_prompts)
        if not want_entropy_grad:
            entropy = entropy.detach()
        agg = counts.aggregation()
        # Without old_log_probs the update is one optimizer step on the policy that sampled the batch
        # (TrainerEngine checks), so the old policy is the current one: its log-probs, detached.
        old_log_probs = batch["old_log_probs"] if "old_log_probs" in batch else log_probs.detach()
        loss_params = {key: self.sections[key] if key in algos.POLICY_LOSS_SECTIONS else getattr(cfg, key)
                       for key in algos.policy_loss_params(cfg.loss_mode)}  # e.g. clip_cov's
        pg_loss, pg_stats = algos.policy_loss(
            old_log_probs, log_probs, batch["advantages"], mask,
            clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
            agg=cfg.loss_agg_mode, mode=cfg.loss_mode, **agg,
            rollout_is_weights=batch["rollout_is_weights"] if "rollout_is_weights" in batch else None,
            **loss_params,
        )
        entropy_agg = algos.aggregate_loss(entropy, mask, cfg.loss_agg_mode, **agg)
        loss = pg_loss - cfg.entropy_coeff * entropy_agg if want_entropy_grad else pg_loss
        kl_loss = log_probs.new_zeros(())
        if cfg.use_kl_loss:
            kl = algos.kl_penalty(log_probs, batch["ref_log_probs"], cfg.kl_loss_type)  # [B, T]
            kl_loss = algos.aggregate_loss(kl, mask, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
        router_stats = {}
        if router_loss is not None:  # a mean over this micro-batch: weighted by its share of the response tokens
            router_loss = router_loss * mask.sum() / max(counts.tokens, 1.0)
            loss = loss + router_coef * router_loss
            router_stats = {"router_aux_loss": router_loss.detach()}
        stats = {
            "pg_loss": pg_loss.detach(),
            "entropy": entropy_agg.detach(),
            "kl_loss": kl_loss.detach(),
            **{name: _token_weight(value, mask, counts) for name, value in pg_stats.items()},
            **router_stats,
        }
        return loss, stats


class ValueObjective:
    """Clipped value loss of the critic."""

    float_names = ("values", "returns")

    def __init__(self, config: CriticConfig):
        self.config = config

    def required_floats(self) -> tuple[str, ...]:
        return self.float_names

    def loss(
        self, model: nn.Module, batch: SequenceBatch, counts: MiniBatchCounts
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["response_mask"].float()  # [B, T]
        values = forward_values(model, batch, packed=self.config.use_remove_padding)  # [B, T]
        loss, stats = algos.value_loss(
            values, batch["returns"], batch["values"], mask,
            clip_range=self.config.cliprange_value, agg=self.config.loss_agg_mode, **counts.aggregation(),
        )
        return loss, {"vf_loss": loss.detach(), **{k: _token_weight(v, mask, counts) for k, v in stats.items()}}
