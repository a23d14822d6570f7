"""The hf rollout engine against transformers' `model.generate` on the same rows: generated tokens/s, on
the CPU or a GPU (whichever torch sees; the engine picks the same).

Both sides run the same model object (the engine's own), the same prompts with n samples each, at
temperature 1 with no top-k/top-p (generate's default top_k=50 is switched off), to the same max_tokens.
EOS is switched off on both sides (random weights would rarely emit it anyway), so every row runs to
max_tokens.
The engine is called in-process (no gRPC): its prompts as one request (`hf_engine`), and as two concurrent
requests of half the prompts (`hf_engine_2_requests`), which is how the coordinator sends a step's prompts
to one replica. Runs alternate (load from elsewhere hits every side alike), after a short warm-up run of
each side; the best of the repeats counts. Writes bench/results/hf_generate.json.

    python -m bench.hf_generate_bench [--shape smollm2-135m] [--prompts 8] [--samples 4] [--max-tokens 64]

The GPU check calls `compare_with_generate(model_dir, ...)` on a model it built (`random_model`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import transformers

from rlfabric.core.config import load_config
from rlfabric.rollout.hf_engine import HFEngine
from rlfabric.rollout.types import SamplingSpec

RESULTS = Path(__file__).parent / "results" / "hf_generate.json"
# Llama shapes of SmolLM2's configs (tied embeddings, 49,152-token vocabulary).
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000.0),
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, rope_theta=130000.0),
}
TARGET = 0.9  # issue 31: the engine's tokens/s at least 0.9x generate's on a GPU; no regression on the CPU


def progress(message: str) -> None:
    print(f"[hf_generate_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def random_model(out_dir: str | Path, shape: str = "smollm2-135m", tokenizer_dir: str | Path | None = None,
                 dtype: torch.dtype = torch.float32) -> Path:
    """A random-weight Llama of one of SHAPES in out_dir; tokenizer_dir's tokenizer (e.g. SmolLM2's), else
    the quickstart's character-level one (ids past its 100 decode to nothing)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlfabric.quickstart.tiny_model import build_tokenizer

    out = Path(out_dir)
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=None, pad_token_id=2, **SHAPES[shape])
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else build_tokenizer()
    tokenizer.save_pretrained(out)
    return out


def bench_prompts(count: int, vocab: int = 49152) -> list[list[int]]:
    """`count` prompts of 24-56 tokens, the same on every run."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (24 + (7 * i) % 33,), generator=generator).tolist() for i in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Run = Callable[[SamplingSpec], int]  # generates every row once; returns the tokens generated


def _engine_run(engine: HFEngine, loop: asyncio.AbstractEventLoop, prompts, requests: int) -> Run:
    """A run of the engine: the prompts as `requests` concurrent requests."""
    size = -(-len(prompts) // requests)

    async def one(part, params: SamplingSpec) -> int:
        return sum([len(s.token_ids) async for s in engine.generate(part, params)])

    async def run(params: SamplingSpec) -> int:
        return sum(await asyncio.gather(*(one(prompts[i:i + size], params) for i in range(0, len(prompts), size))))

    return lambda params: loop.run_until_complete(run(params))


def _generate_run(net, prompts, pad: int) -> Run:
    """A run of model.generate on the same rows (left-padded, num_return_sequences = n)."""
    width = max(map(len, prompts))
    device = net.device
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def run(params: SamplingSpec) -> int:
        with torch.inference_mode():
            out = net.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, max_new_tokens=params.max_tokens,
                               num_return_sequences=params.n, pad_token_id=pad, eos_token_id=None)
        _sync(device)
        return int((out.shape[1] - width) * out.shape[0])

    return run


def compare_with_generate(model_dir: str | Path, prompts: int = 16, samples: int = 8, max_tokens: int = 256,
                          repeats: int = 2, steps_per_sync: Sequence[int] = (), dtype: str = "auto") -> dict:
    """Tokens/s of the hf engine and of model.generate on the same rows (prompts x samples x max_tokens).

    steps_per_sync: extra engine variants with that many decode steps between host reads (the engine's
    default is always measured). Returns the result entry, "engine_vs_generate" the key figure."""
    config = load_config(None, [f"model.path={model_dir}", f"rollout.max_num_seqs={prompts * samples}",
                                f"rollout.dtype={dtype}", "rollout.request_timeout_s=3600"])
    engine = HFEngine(config)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    engine.limits = replace(engine.limits, eos_token_ids=())  # generate gets eos_token_id=None
    try:
        rows = bench_prompts(prompts, engine.limits.vocab_size)
        params = SamplingSpec(n=samples, max_tokens=max_tokens, temperature=1.0, seed=1234, logprobs=True)
        default = engine.steps_per_sync
        sides = {"hf_engine": (default, _engine_run(engine, loop, rows, 1)),
                 "hf_engine_2_requests": (default, _engine_run(engine, loop, rows, 2))}
        for steps in steps_per_sync:
            if steps != default:
                sides[f"hf_engine_sync_{steps}"] = (steps, sides["hf_engine"][1])
        sides["generate"] = (None, _generate_run(engine.net, rows, engine.tokenizer.pad_token_id or 0))
        return _measure(engine, sides, repeats, rows, params, default)
    finally:
        loop.run_until_complete(engine.stop())
        loop.close()


def _measure(engine: HFEngine, sides: dict, repeats: int, rows, params: SamplingSpec, default: int) -> dict:
    """Warms each side up (the same rows, 8 tokens), then times the sides in turn `repeats` times."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, int] = {}
    for repeat in range(repeats + 1):  # round 0 warms up (kernels, allocator) and is not counted
        for name, (steps, run) in sides.items():
            if steps is not None:
                engine.steps_per_sync = steps
            _sync(engine.device)
            start = time.perf_counter()
            count = run(params if repeat else replace(params, max_tokens=min(8, params.max_tokens)))
            elapsed = time.perf_counter() - start
            engine.steps_per_sync = default
            if repeat:
                seconds[name].append(elapsed)
                tokens[name] = count
                progress(f"{name}: repeat {repeat}/{repeats}: {elapsed:.2f} s, {count / elapsed:.0f} tokens/s")
    per_s = {name: tokens[name] / min(s) for name, s in seconds.items()}
    return {
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else platform.processor()
        or platform.machine(),
        "rows": len(rows) * params.n, "prompts": len(rows), "samples": params.n, "max_tokens": params.max_tokens,
        "dtype": str(next(engine.net.parameters()).dtype), "steps_per_sync_default": default,
        "tokens_per_run": tokens,
        "tokens_per_s": {name: round(value, 1) for name, value in per_s.items()},
        "engine_vs_generate": round(per_s["hf_engine"] / per_s["generate"], 3),
        "median_engine_vs_generate": round(statistics.median(seconds["generate"]) / statistics.median(
            seconds["hf_engine"]), 3),
        "seconds": {name: [round(x, 3) for x in s] for name, s in seconds.items()},
        "target_engine_vs_generate": TARGET,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_result(key: str, entry: dict, path: Path = RESULTS) -> None:
    """Records entry under results[key] (other keys keep their last entry)."""
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps-per-sync", default="", help="extra engine variants, comma-separated, e.g. 1,16")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: SmolLM2's when cached)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file (its other entries are kept)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        # One intra-op thread, as rollout_bench: on a small shared machine OpenMP threads waiting for each
        # other under load from other processes make single runs swing; the ratio is what counts here.
        torch.set_num_threads(1)
    tokenizer = args.tokenizer
    if tokenizer is None:
        from rlfabric.core.model_cache import DONE_MARKER, cache_root

        cached = cache_root() / "smollm2"
        tokenizer = cached if (cached / DONE_MARKER).exists() else None
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"building a random {args.shape} model")
        model_dir = random_model(Path(tmp) / "model", args.shape, tokenizer)
        entry = compare_with_generate(model_dir, args.prompts, args.samples, args.max_tokens, args.repeats,
                                      [int(s) for s in args.steps_per_sync.split(",") if s])
    entry["shape"] = args.shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    write_result(device, entry, args.out)
    progress(f"{device}: hf engine {entry['tokens_per_s']['hf_engine']} tokens/s, generate "
             f"{entry['tokens_per_s']['generate']} tokens/s: {entry['engine_vs_generate']}x (target >= {TARGET} "
             f"on a GPU); wrote {args.out}")


if __name__ == "__main__":
    main()
