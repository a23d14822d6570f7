"""A paper model of weight sync at 64-1,024 GPUs, fitted to the figures measured here (issue 49, item 5).

    python -m bench.weight_sync_model          (also run by `python -m bench.figures`: docs/generated/)

Per sync, for R rollout replicas of a model of P parameters sent as bfloat16 (M = 2P bytes) over links of B
bytes/s:

- direct (the actor pushes to every replica): the actor's link carries R * M, so T = R * M / B;
- chain (weight_sync.relay: chain): the actor sends one copy, each replica forwards each chunk of C bytes as it
  arrives: T = M / B + (R - 1) * (C / B + h), h a fixed cost per hop;
- tree (not built): each replica forwards to `fanout` others, so each link carries `fanout` copies and a chunk
  crosses ceil(log_fanout(R + 1)) hops: T = fanout * M / B + depth * (fanout * C / B + h);
- delta + chain (weight_sync.delta): the same with rho * M bytes, after the actor's pass over every weight
  (E = P / e seconds, e elements per second on one host core, as implemented now; or P / (e * A) with the pass
  split over the actor's A ranks, each encoding its own shard on one core: not built, derived from e);
and each sync pays a fixed t0 (RPCs, the pause and resume of the replicas).

On one host of K cores the processes share them: the actor and every replica each spend about one
single-replica sync of CPU, so T >= (R + 1) * T_1 / K there. That bound, not the network, is what the chain
runs here show past one replica.

Fitted here (bench/results/): B is loopback gRPC's rate in a full SmolLM2 sync (weight_sync_delta.json), h the
slope of the tiny model's chain time over N = 1..8 and t0 its value at N = 1 (weight_sync_relay.json; its 178 KB
fit in one chunk, so the slope is per-hop cost alone), rho the delta's bytes at each learning rate and e the delta's extra pack time
(weight_sync_delta.json). The extrapolation replaces B by a datacenter link; the constants below say which.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CHUNK_BYTES = 4 << 20  # rlfabric.weight_sync.grpc_stream.CHUNK_BYTES: what a replica forwards at once
SMOLLM2_PARAMS = 134_515_008  # SmolLM2-135M: 269,030,016 bytes in bfloat16
# Links per replica host. InfiniBand NDR (400 Gb/s, one NIC per GPU on H100/H200 nodes) and 100 Gb/s Ethernet
# (a cloud node's NIC, or the grpc transport between clusters); both at line rate, no protocol overhead.
LINKS = {"IB 400 Gb/s": 400e9 / 8, "Ethernet 100 Gb/s": 100e9 / 8}
# The models extrapolated to, each with the rollout tensor-parallel size a replica would use on 80-141 GB GPUs.
MODELS = {"8B (TP 1)": (8.2e9, 1), "70B (TP 4)": (70.6e9, 4), "235B (TP 8)": (235e9, 8)}
GPUS = (64, 256, 1024)
ROLLOUT_SHARE = 0.5  # half the GPUs generate (a common disaggregated split); the rest train
TREE_FANOUT = 2
LEARNING_RATE = "1e-06"  # the delta's rate in the extrapolation (the RL rate)


@dataclass(frozen=True)
class Fit:
    link_bytes_s: float  # loopback gRPC, full SmolLM2 sync: bytes / wire seconds
    fixed_s: float  # t0: per sync, whatever the size
    hop_s: float  # fixed cost per relay hop
    hop_fit_r2: float
    delta_bytes_ratio: dict[str, float]  # learning rate -> delta bytes / full bytes
    encode_elements_s: float  # the actor's delta pass: elements per second, one core


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def fit() -> Fit:
    delta, relay = _load("weight_sync_delta.json"), _load("weight_sync_relay.json")
    full_rows = [row for rate in delta["learning_rates"].values() for row in rate["rows"] if row["kind"] == "full"]
    link = statistics.median(row["bytes"] / row["phases"]["wire"] for row in full_rows)
    tiny = relay["models"]["tiny"]["replicas"]
    xs = [float(n) for n in tiny for _ in tiny[n]["chain"]["rows"]]
    ys = [row["seconds"] for n in tiny for row in tiny[n]["chain"]["rows"]]
    hop, at_zero = statistics.linear_regression(xs, ys)
    r2 = statistics.correlation(xs, ys) ** 2
    at = delta["learning_rates"][LEARNING_RATE]["phases_median"]
    extra_pack_s = at["delta"]["pack"] - at["full"]["pack"]  # the pack both do (the cast) left out
    return Fit(link_bytes_s=link, fixed_s=at_zero + hop, hop_s=hop, hop_fit_r2=r2,
               delta_bytes_ratio={rate: v["bytes_ratio"] for rate, v in delta["learning_rates"].items()},
               encode_elements_s=SMOLLM2_PARAMS / extra_pack_s)


def sync_seconds(params: float, replicas: int, link: float, f: Fit, how: str, actor_ranks: int = 1) -> float:
    """The model's seconds for one sync; `how`: direct, chain, delta_chain (one core encodes), or
    delta_chain_sharded (each of `actor_ranks` encodes its shard)."""
    model_bytes = 2 * params
    hops = (replicas - 1) * (CHUNK_BYTES / link + f.hop_s)
    if how == "direct":
        return f.fixed_s + replicas * model_bytes / link
    if how == "chain":
        return f.fixed_s + model_bytes / link + hops
    if how == "tree":
        depth = math.ceil(math.log(replicas + 1, TREE_FANOUT) - 1e-9)
        return f.fixed_s + TREE_FANOUT * model_bytes / link + depth * (TREE_FANOUT * CHUNK_BYTES / link + f.hop_s)
    if how in ("delta_chain", "delta_chain_sharded"):
        encoders = actor_ranks if how == "delta_chain_sharded" else 1
        sent = f.delta_bytes_ratio[LEARNING_RATE] * model_bytes
        return f.fixed_s + params / (f.encode_elements_s * encoders) + sent / link + hops
    raise ValueError(how)


HOWS = ("direct", "chain", "tree", "delta_chain", "delta_chain_sharded")


def layout(gpus: int, tp: int) -> tuple[int, int]:
    """(rollout replicas, actor ranks) of `gpus` GPUs: ROLLOUT_SHARE of them generate, `tp` to a replica."""
    generating = int(gpus * ROLLOUT_SHARE)
    return generating // tp, gpus - generating


def extrapolation(f: Fit) -> list[dict]:
    rows = []
    for model, (params, tp) in MODELS.items():
        for gpus in GPUS:
            replicas, actor_ranks = layout(gpus, tp)
            for link_name, link in LINKS.items():
                rows.append({"model": model, "gpus": gpus, "replicas": replicas, "link": link_name,
                             "model_gb": 2 * params / 1e9, "direct_egress_gb": replicas * 2 * params / 1e9,
                             **{how: sync_seconds(params, replicas, link, f, how, actor_ranks) for how in HOWS}})
    return rows


def measured_against_model(f: Fit) -> list[tuple[str, float, float, float]]:
    """(what, measured s, the model's s, the shared-host bound (R + 1) * T_1 / K) for the chain runs here, on
    loopback (the fitted link)."""
    relay = _load("weight_sync_relay.json")
    out = []
    for name in ("tiny", "smollm2"):
        runs = relay["models"][name]["replicas"]
        params = runs["1"]["chain"]["rows"][0]["bytes"] / 2
        for n, sides in runs.items():
            shared = (int(n) + 1) * runs["1"]["chain"]["median_s"] / relay["cpus"]
            out.append((f"{name}, {n} replica{'s' if n != '1' else ''}", sides["chain"]["median_s"],
                        sync_seconds(params, int(n), f.link_bytes_s, f, "chain"), shared))
    return out


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 100 else f"{seconds:,.0f} s"


def table() -> str:
    """docs/generated/weight-sync-model.md."""
    f = fit()
    lines = [
        "| fitted | value | from |",
        "| --- | --- | --- |",
        f"| B, loopback gRPC (full SmolLM2 sync) | {f.link_bytes_s / 1e9:.2f} GB/s | weight_sync_delta.json, "
        "full syncs' wire |",
        f"| t0, fixed cost per sync | {f.fixed_s * 1e3:.1f} ms | weight_sync_relay.json, the same fit at N = 1 |",
        f"| h, fixed cost per relay hop | {f.hop_s * 1e3:.1f} ms (r² {f.hop_fit_r2:.2f}) | weight_sync_relay.json, "
        "tiny model, chain, N = 1..8 |",
        f"| e, the actor's delta pass (one core) | {f.encode_elements_s / 1e9:.2f} G elements/s | "
        "weight_sync_delta.json, delta pack - full pack, lr 1e-6 |",
        "| rho, delta bytes / full bytes | " + ", ".join(f"{v:.4f} (lr {rate})" for rate, v in
                                                        f.delta_bytes_ratio.items()) + " | weight_sync_delta.json |",
        "",
        "| chain run here (loopback, 2 cores) | measured | model | shared-host bound |",
        "| --- | --- | --- | --- |",
        *[f"| {what} | {measured:.3f} s | {model:.3f} s | {shared:.3f} s |"
          for what, measured, model, shared in measured_against_model(f)],
        "",
        f"| model | GPUs | replicas | link | direct: actor egress | direct | chain | tree, fanout 2 (not built) "
        f"| delta (lr {float(LEARNING_RATE):g}) + chain, one core encodes | the same, each actor rank encodes its shard |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {r['model']} | {r['gpus']} | {r['replicas']} | {r['link']} | {r['direct_egress_gb']:,.0f} GB | "
          f"{_s(r['direct'])} | {_s(r['chain'])} | {_s(r['tree'])} | {_s(r['delta_chain'])} | {_s(r['delta_chain_sharded'])} |"
          for r in extrapolation(f)],
    ]
    return "\n".join(lines) + "\n"


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = fit()
    link_name, link = next(iter(LINKS.items()))
    fig, axes = plt.subplots(1, len(MODELS), figsize=(13, 4), sharey=True)
    for axis, (model, (params, tp)) in zip(axes, MODELS.items(), strict=True):
        gpus = [g for g in range(16, 1025, 16) if layout(g, tp)[0] >= 1]
        for how, label in (("direct", "direct push"), ("chain", "relay: chain"), ("tree", "tree, fanout 2 (not built)"),
                           ("delta_chain", f"delta (lr {float(LEARNING_RATE):g}) + chain, one core encodes"),
                           ("delta_chain_sharded", "the same, each actor rank encodes its shard")):
            seconds = [sync_seconds(params, layout(g, tp)[0], link, f, how, actor_ranks=layout(g, tp)[1]) for g in gpus]
            axis.plot(gpus, seconds, label=label)
        axis.set_title(f"{model}, {link_name}")
        axis.set_xlabel("GPUs (half generate)")
        axis.set_yscale("log")
        axis.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("seconds per sync (model)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Weight sync, paper model fitted to this machine's figures (bench/weight_sync_model.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    print(table())
    plot(ROOT / "docs" / "img" / "weight-sync-model.png")


if __name__ == "__main__":
    main()
