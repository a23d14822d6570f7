"""Tensor codec throughput: encode + serialize + parse + decode, next to a plain memory copy of
the same bytes, measured side by side in one process. Writes bench/results/codec.json.

    python -m bench.codec_bench
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from rlfabric.core import codec
from rlfabric.v1 import tensor_pb2

RESULTS = Path(__file__).parent / "results" / "codec.json"


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(num_bytes: int, dtype: torch.dtype, repeats: int = 5) -> dict:
    numel = num_bytes // torch.empty(0, dtype=dtype).element_size()
    value = torch.randn(numel).to(dtype)
    raw = value.view(torch.uint8).numpy() if dtype != torch.bfloat16 else value.view(torch.int16).numpy()

    def memcpy():
        np.copyto(np.empty_like(raw), raw)

    def codec_round_trip():  # what a request costs end to end in-process: encode, wire bytes, decode
        wire = codec.encode(value).SerializeToString()
        decoded = codec.to_torch(tensor_pb2.Tensor.FromString(wire))
        assert decoded.shape == value.shape

    def encode_decode_only():
        decoded = codec.to_torch(codec.encode(value))
        assert decoded.shape == value.shape

    copy_s = _best_seconds(memcpy, repeats)
    round_trip_s = _best_seconds(codec_round_trip, repeats)
    codec_s = _best_seconds(encode_decode_only, repeats)
    gb = num_bytes / 1e9
    return {
        "bytes": num_bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "memcpy_gb_s": round(gb / copy_s, 2),
        "encode_decode_gb_s": round(gb / codec_s, 2),
        "encode_serialize_parse_decode_gb_s": round(gb / round_trip_s, 2),
        "encode_decode_vs_memcpy": round(copy_s / codec_s, 3),
    }


def main() -> None:
    rows = []
    for size in (1 << 20, 64 << 20, 256 << 20):
        for dtype in (torch.float32, torch.bfloat16):
            row = measure(size, dtype)
            print(f"codec {row['dtype']:>8} {size >> 20:>4} MiB: memcpy {row['memcpy_gb_s']} GB/s, "
                  f"encode+decode {row['encode_decode_gb_s']} GB/s "
                  f"({row['encode_decode_vs_memcpy']:.2f}x memcpy), "
                  f"with serialize+parse {row['encode_serialize_parse_decode_gb_s']} GB/s", flush=True)
            rows.append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.machine(), "cpus": torch.get_num_threads(),
                                   "results": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
