"""Methods mixed into every vLLM worker (vLLM's `worker_extension_cls`), called through
`collective_rpc`. Imported inside vLLM's worker processes: no vLLM import at module level.

Bulk tensors cannot travel as collective_rpc arguments (on vLLM CPU they arrive as Python lists),
so weights reach the workers through a safetensors file in shared memory today, and through a
process group (the weight-sync issue) later; both end in `rlfabric_apply_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class RlfabricWorkerExtension:
    def rlfabric_load_weights_file(self, path: str) -> int:
        """Loads every tensor of a safetensors file (Hugging Face names) into the model."""
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as tensors:
            names = list(tensors.keys())
            self.rlfabric_apply_weights((name, tensors.get_tensor(name)) for name in names)
        return len(names)

    def rlfabric_apply_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The one way weights enter the model. vLLM's in-place reload redoes the post-load processing
        (e.g. the CPU GEMM repacking), which a plain model.load_weights after start-up does not."""
        self.reload_weights(weights_iterator=weights)
        self._rlfabric_refresh_tied_head()

    def _rlfabric_refresh_tied_head(self) -> None:
        """vLLM CPU packs lm_head's weight for its GEMM at load time. With tied embeddings the reload
        updates the shared weight through embed_tokens but leaves lm_head's packed copy stale (its
        own layer loads nothing), so lm_head's post-load processing is redone here."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
            return
        with set_current_vllm_config(self.vllm_config):
            head.quant_method.process_weights_after_loading(head)
