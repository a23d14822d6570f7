"""Loading the models of the three roles from a local Hugging Face directory, and sharding them with FSDP2.

- actor, reference: AutoModelForCausalLM (the actor wrapped in peft adapters with actor.lora, lora.py).
- critic: AutoModelForTokenClassification with num_labels=1: the same backbone as the policy with a
  scalar head per position. It is the Hugging Face class for exactly this shape, exists for every
  common decoder (Qwen2, Llama, Mistral, ...), saves and loads with save_pretrained/from_pretrained,
  and loading it from a causal-LM directory keeps the backbone weights and initialises only the head.

dtype: model.dtype is the compute dtype (auto = float32 on CPU, bfloat16 on GPU). Trained models keep
float32 master weights (float64 ones when the compute dtype is float64) and compute in that dtype through
FSDP2's MixedPrecisionPolicy (or autocast on a single GPU); the frozen reference is loaded directly in it.
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch
from torch import nn

from rlfabric.core.config import RunConfig
from rlfabric.core.dtypes import at_least_float32, torch_dtype
from rlfabric.core.host import check_model_directory
from rlfabric.core.moe import check_router_aux_loss, check_router_replay
from rlfabric.trainer.roles import role_spec


def rank_device(rank: int) -> torch.device:
    """cuda:<local rank> when a GPU is present, else cpu."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    return torch.device("cuda", local_rank)


def load_model(role: str, config: RunConfig, device: torch.device) -> nn.Module:
    """The role's model on CPU, in train mode (actor, critic) or frozen in eval mode (reference)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    spec = role_spec(role)
    trainable = spec.trainable
    dtype = torch_dtype(config.model.dtype, device)
    if trainable:
        dtype = master_dtype(dtype)
    kwargs = dict(
        dtype=dtype,
        attn_implementation=config.model.attn_implementation,
        trust_remote_code=config.model.trust_remote_code,
    )
    if dtype == torch.float64:  # torch's grouped_mm, transformers' default for MoE experts, has no float64 kernel
        kwargs["experts_implementation"] = "eager"
    path = spec.model_path(config)
    if spec.trains_policy:
        check_router_aux_loss(config)  # a coefficient for a model without a router is a mistake
        check_router_replay(config)
    if spec.value_head:
        hf_config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=config.model.trust_remote_code)
        hf_config.classifier_dropout = 0.0  # dropout on the value head would make the values noisy
        model = AutoModelForTokenClassification.from_pretrained(path, config=hf_config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.config.use_cache = False
    if not trainable:
        model.requires_grad_(False)
        model.eval()
        return model
    if uses_gradient_checkpointing(config, device):
        enable_gradient_checkpointing(model)
    if spec.takes_lora and config.actor.lora.enabled:
        from rlfabric.core.lora import apply_lora

        model = apply_lora(model, config.actor.lora)  # freezes the base; only the adapters train
    model.train()
    return model


def master_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype trained weights, their gradients' reductions and optimizer state are kept in: float32, or
    float64 for a float64 compute dtype."""
    return at_least_float32(compute_dtype)


def uses_gradient_checkpointing(config: RunConfig, device: torch.device) -> bool:
    """model.gradient_checkpointing, with auto resolved: on for a GPU, where activations bound the
    micro-batch; off on CPU, where compute does."""
    setting = config.model.gradient_checkpointing
    return device.type == "cuda" if setting == "auto" else bool(setting)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant checkpointing of every decoder layer (transformers 5 renamed the switch)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def shard_model(model: nn.Module, world_size: int, device: torch.device, dtype: torch.dtype,
                offload: bool = False, mesh=None) -> nn.Module:
    """FSDP2: each decoder layer is one unit (its parameters gathered just for its forward/backward),
    the embeddings, final norm and head are the root unit. Gradients are reduced in the master dtype. `offload`
    (a GPU shared with the rollout, trainer.colocated): FSDP2's CPU offload keeps the shards, their
    gradients and so the optimizer state in host memory; only a unit being computed is on the GPU.
    `mesh`: the data-parallel mesh (with tensor parallelism, mesh["dp"] of tensor_parallel.device_mesh);
    default: all world_size ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=master_dtype(dtype))
    placement = CPUOffloadPolicy() if offload else OffloadPolicy()
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=placement)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=placement)
    return model


def autocast(device: torch.device, dtype: torch.dtype, sharded: bool):
    """Mixed precision of an unsharded trained model on GPU; FSDP2 does it itself when sharded.
    No cast cache: it would hold a bf16 copy of every weight until the forward pass ends (3.4 GB for a 1.7B
    model), though each weight is cast once per pass anyway, and a checkpointed layer casts its own again."""
    if sharded or dtype == torch.float32 or device.type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the causal LM can skip the LM head over the prompt (transformers' logits_to_keep)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def vocab_size(model: nn.Module) -> int:
    """Rows of the input embedding: the largest token id + 1 the model accepts."""
    return int(model.get_input_embeddings().num_embeddings)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Heads that do not generate text: a checkpoint whose architectures all end in one of these is no policy.
NOT_GENERATIVE_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForMaskedLM",
                           "ForQuestionAnswering", "ForMultipleChoice", "ForNextSentencePrediction",
                           "ForPreTraining", "Model")


def check_policy_model(path: str, trust_remote_code: bool = False) -> None:
    """Checks, before any service loads it, that `path` holds what the mesh needs from the policy: a
    causal LM, a tokenizer whose ids fit its embedding, and a chat template (prompts in VeRL's schema
    are chat messages). ValueError names the path and what is wrong."""
    from transformers import AutoConfig, AutoTokenizer

    check_model_directory(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"model.path {path}: config.json does not load: {error}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = list(getattr(config, "architectures", None) or [])
    causal_type = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or trust_remote_code
    if not causal_type or (architectures and all(a.endswith(NOT_GENERATIVE_SUFFIXES) for a in architectures)):
        held = ", ".join(architectures) or "model"
        raise ValueError(f"model.path {path} holds a {held} (model_type {config.model_type}), not a causal language "
                         "model (one AutoModelForCausalLM loads with a text-generating head)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"model.path {path}: the tokenizer does not load: {error}") from None
    embedding_rows = getattr(config, "vocab_size", None)
    if embedding_rows is not None and len(tokenizer) > embedding_rows:
        raise ValueError(f"model.path {path}: the tokenizer has {len(tokenizer)} tokens but the model's embedding "
                         f"only {embedding_rows} rows (vocab_size): the tokenizer belongs to another model")
    if not tokenizer.chat_template:
        raise ValueError(f"model.path {path}: the tokenizer has no chat template, and prompts are chat messages "
                         "(VeRL's schema); add one (tokenizer_config.json chat_template or chat_template.jinja)")


def check_teacher_tokenizer(config: RunConfig) -> None:
    """With algorithm.distill: the teacher (teacher.model_path) scores the student's token ids, so its tokenizer
    must be the policy's (model.path): the same vocabulary (token -> id) and the same special tokens. ValueError
    naming teacher.model_path and the first difference otherwise."""
    if not config.algorithm.distill.enable:
        return
    from transformers import AutoTokenizer

    path, trust = config.teacher.model_path, config.model.trust_remote_code
    check_model_directory(path, "teacher.model_path")
    try:
        teacher = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"teacher.model_path {path}: the tokenizer does not load: {error}") from None
    student = AutoTokenizer.from_pretrained(config.model.path, trust_remote_code=trust)
    difference = _tokenizer_difference(student, teacher)
    if difference:
        raise ValueError(f"teacher.model_path {path}: its tokenizer is not model.path's ({difference}); algorithm.distill "
                         "scores the student's token ids under the teacher, so the two models need one tokenizer")


def _tokenizer_difference(student, teacher) -> str:
    """The first way two tokenizers differ in the ids they give, in words; "" when they agree."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if len(student_vocab) != len(teacher_vocab):
        return f"{len(teacher_vocab)} tokens against the student's {len(student_vocab)}"
    for token, token_id in student_vocab.items():
        if teacher_vocab.get(token) != token_id:
            return f"token {token!r} is id {teacher_vocab.get(token)} against the student's {token_id}"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(teacher, name)} against the student's {getattr(student, name)}"
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens):
        return f"special tokens {sorted(teacher.all_special_tokens)} against the student's {sorted(student.all_special_tokens)}"
    return ""
