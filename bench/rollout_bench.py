"""Rollout throughput: generated tokens/s through the gRPC service (typed client over loopback)
next to calling the same engine object directly in the same process, same batch and seed, runs
alternated; the best of REPEATS runs counts (the median ratio is recorded too). Engines: hf always; vllm where it is installed (others keep their last recorded entry).
Writes bench/results/rollout.json.

    python -m bench.rollout_bench [--engines hf,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import torch
import transformers

from rlfabric.core.config import load_config
from rlfabric.core.server import ServerOptions
from rlfabric.quickstart.tiny_model import make_tiny_model
from rlfabric.rollout.client import RolloutClient
from rlfabric.rollout.servicer import build_service
from rlfabric.rollout.types import SamplingSpec
from tests.conftest import ServerThread

RESULTS = Path(__file__).parent / "results" / "rollout.json"
MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, intermediate_size=512)  # head_dim 32, ~1.3 M params
PROMPTS = [[1 + (i * 7 + j) % 90 for j in range(16 + i % 8)] for i in range(32)]  # 32 prompts, 16-23 tokens
PARAMS = SamplingSpec(n=4, max_tokens=64, temperature=1.0, seed=1234, logprobs=True)
REPEATS = 7


def progress(message: str) -> None:
    print(f"[rollout_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def _open_client(address: str) -> RolloutClient:
    return RolloutClient(address)


def measure(engine_name: str, model_dir: Path) -> dict:
    config = load_config(None, [f"model.path={model_dir}", f"rollout.engine={engine_name}", "rollout.max_num_seqs=128"])
    service = build_service(config)
    progress(f"{engine_name}: starting the engine and its server")
    server = ServerThread(service, ServerOptions(port=0, metrics_port=None))
    engine = service.engine

    async def direct() -> int:
        return sum([len(s.token_ids) async for s in engine.generate(PROMPTS, PARAMS)])

    # The caller's side of the service path: one event loop and one client (channel) for every run.
    caller = asyncio.new_event_loop()
    client = caller.run_until_complete(_open_client(server.address))

    async def through_service() -> int:
        return sum(len(s.token_ids) for s in await client.generate(PROMPTS, PARAMS))

    runs = {"direct": lambda: server.run(direct(), timeout=600),
            "service": lambda: caller.run_until_complete(through_service())}
    seconds: dict[str, list[float]] = {"direct": [], "service": []}
    counts = set()
    try:
        for run in runs.values():  # warm-up (kernels, allocator, connection)
            run()
        for repeat in range(REPEATS):  # alternated, so load from elsewhere hits both alike
            for mode, run in runs.items():
                start = time.perf_counter()
                counts.add(run())
                seconds[mode].append(time.perf_counter() - start)
            progress(f"{engine_name}: repeat {repeat + 1}/{REPEATS}: direct {seconds['direct'][-1]:.2f} s, "
                     f"service {seconds['service'][-1]:.2f} s")
    finally:
        caller.run_until_complete(client.close())
        caller.close()
        server.stop()
    direct_s, service_s = seconds["direct"], seconds["service"]
    tokens = max(counts)
    # Best of the repeats: the machine is shared, and interference only ever adds time.
    direct_tps, service_tps = tokens / min(direct_s), tokens / min(service_s)
    return {
        "tokens_per_run": tokens,
        "same_tokens_both_ways": len(counts) == 1,
        "direct_tokens_per_s": round(direct_tps, 1),
        "service_tokens_per_s": round(service_tps, 1),
        "service_vs_direct": round(service_tps / direct_tps, 3),
        "median_service_vs_direct": round(statistics.median(direct_s) / statistics.median(service_s), 3),
        "direct_seconds": [round(s, 3) for s in direct_s],
        "service_seconds": [round(s, 3) for s in service_s],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="hf,vllm")
    args = parser.parse_args(argv)
    # One intra-op thread: on a small shared machine, OpenMP threads waiting for each other under
    # load from other processes make single runs swing 10x; the ratio is what this bench is about.
    torch.set_num_threads(1)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.setdefault("engines", {})
    with tempfile.TemporaryDirectory() as tmp:
        progress("building the benchmark model")
        model_dir = make_tiny_model(Path(tmp) / "model", **MODEL)
        for name in args.engines.split(","):
            if name == "vllm" and find_spec("vllm") is None:
                progress("vllm: not installed here, keeping its last recorded entry")
                continue
            entry = measure(name, model_dir)
            entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            entry["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                 **({"vllm": __import__("vllm").__version__} if name == "vllm" else {})}
            results["engines"][name] = entry
            progress(f"{name}: service {entry['service_tokens_per_s']} tok/s vs direct "
                     f"{entry['direct_tokens_per_s']} tok/s = {entry['service_vs_direct']:.3f} (target >= 0.95)")
    results.update({
        "batch": {"prompts": len(PROMPTS), "n": PARAMS.n, "max_tokens": PARAMS.max_tokens, "temperature": PARAMS.temperature},
        "model": {"kind": "random Qwen2, char tokenizer", **MODEL},
        "machine": {"torch_threads": torch.get_num_threads(), "platform": platform.platform()},
        "target_service_vs_direct": 0.95,
    })
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    progress(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
