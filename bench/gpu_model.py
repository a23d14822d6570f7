"""A random-weight model of a known shape with a real tokenizer, for the GPU check's rlfabric-vs-TRL pair:
no model hub needed, only the tokenizer's few files (`make gpu-wheels` carries SmolLM2's).

    python -m bench.gpu_model OUT --shape smollm2-1.7b --tokenizer DIR [--device cuda]

smollm2-1.7b is SmolLM2-1.7B-Instruct's config.json (a Llama: hidden 2048, 24 layers, 32 heads and 32 KV
heads of 64, MLP 8192, vocabulary 49,152, tied embeddings, RoPE theta 130,000, 8,192 positions): 1.71B
parameters, saved in bfloat16 (3.4 GB). tiny is the same architecture at a size a CPU test builds in a
second. Random weights almost never emit EOS, so every sample runs to its max tokens on both sides.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

SHAPES = {
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                         head_dim=64, intermediate_size=8192, max_position_embeddings=8192, rope_theta=130000.0,
                         rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                 intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json")


def build(out: Path, shape: str, tokenizer_dir: Path, device: str = "cpu", seed: int = 0) -> dict:
    """Writes config, bfloat16 random weights and the tokenizer to `out`; what was built."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=eos, pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                         else eos, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in TOKENIZER_FILES:  # what save_pretrained may leave out (a chat template file of its own)
        if (tokenizer_dir / name).exists() and not (out / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    built = {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
             "dtype": "bfloat16", "seconds": round(time.perf_counter() - started, 2), "path": str(out)}
    (out / "gpu_check_model.json").write_text(json.dumps(built))
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with the tokenizer's files")
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: seconds)")
    args = parser.parse_args()
    print(json.dumps(build(args.out, args.shape, args.tokenizer, args.device)), flush=True)


if __name__ == "__main__":
    main()
