"""docs/generated/benchmarks.md: the benchmarks page's summary, one row per bench/results file, every figure in
it read from that file (`python -m bench.figures` writes it, with the other generated tables)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _time_to_first_step(r: dict) -> str:
    def before_after(key: str, engine: str, fmt: str = "{:.1f}") -> str:
        before, after = r[f"{engine}_before"]["summary"][key], r[f"{engine}_after"]["summary"][key]
        return f"{fmt.format(before)} -> {fmt.format(after)} s"
    return (f"StartRun -> first Generate: vLLM {before_after('start_run_to_first_generate_s', 'vllm')}, "
            f"hf {before_after('start_run_to_first_generate_s', 'hf')}, of which the first sync "
            f"{r['vllm_after']['summary']['first_sync_transfer_s']:.1f} s; the StartRun call vLLM "
            f"{before_after('start_run_rpc_s', 'vllm')}, hf {before_after('start_run_rpc_s', 'hf')}; launch -> "
            f"first step's end vLLM {before_after('launch_to_first_step_end_s', 'vllm', '{:.0f}')}, "
            f"hf {before_after('launch_to_first_step_end_s', 'hf', '{:.0f}')}")


def _codec(r: dict) -> str:
    row = {(x["bytes"], x["dtype"]): x for x in r["results"]}
    big, small = row[(64 << 20, "float32")], row[(1 << 20, "float32")]
    return (f"64 MiB: {big['encode_decode_gb_s']} GB/s vs {big['memcpy_gb_s']} GB/s memcpy of the same bytes "
            f"({big['encode_decode_vs_memcpy']:.2f}x); 1 MiB: {small['encode_decode_gb_s']} vs "
            f"{small['memcpy_gb_s']} GB/s")


def _reward(r: dict) -> str:
    one = next(x for x in r["service_items_per_s"] if x["replicas"] == 1 and x["request_items"] == 256)
    return (f"{one['items_per_s']:,} items/s through one service in 256-item requests (the library in-process: "
            f"{r['library_items_per_s']['256']:,}/s)")


def _judge(r: dict) -> str:
    def one(model: dict) -> str:
        batched, unbatched = model["modes"]["batched"], model["modes"]["unbatched"]
        return (f"{model['judge_model']}, {len(batched['scores'])} items: {batched['items_per_s']:.2f} vs "
                f"{unbatched['items_per_s']:.2f} items/s ({model['batched_vs_unbatched']:.2f}x)")
    return "; ".join(one(model) for model in r["models"].values()) + f" (target {r['target_batched_vs_unbatched']:g}x)"


def _actor(r: dict) -> str:
    big = next(x for x in r["results"] if x["model"] != "tiny")
    tiny = next(x for x in r["results"] if x["model"] == "tiny" and x["world_size"] == 1)
    return (f"{big['model']} ({big['parameters'] / 1e6:.0f}M parameters), 1 rank: {big['train_tokens_per_s']:.0f} "
            f"tokens/s, {big['outside_fwd_bwd_and_optimizer_share']:.1%} of the step outside forward, backward and "
            f"optimizer (tiny model: {tiny['outside_fwd_bwd_and_optimizer_share']:.1%})")


def _rollout(r: dict) -> str:
    engines = r["engines"]
    return (f"tokens/s through the service over the engine called directly: hf {engines['hf']['service_vs_direct']:.2f}, "
            f"vLLM {engines['vllm']['service_vs_direct']:.2f} (target {r['target_service_vs_direct']})")


def _weight_sync(r: dict) -> str:
    rows = [f"{x['transport']} to {x['receivers']}: {x['transfer_gb_s']:.2f} GB/s ({x['vs_raw_tcp']:.2f}x raw TCP; "
            f"target {x['target_vs_raw_tcp']})" for x in r["results"]]
    paused = [s for x in r["results"] for sync in x["paused_seconds"] for s in sync.values()]
    return f"{r['weights_bytes'] >> 30} GiB: " + "; ".join(rows) + (
        f"; the rollout paused {min(paused):.2f}-{max(paused):.2f} s a sync")


def _weight_sync_phases(r: dict) -> str:
    old, new = r["sides"]["old"], r["sides"]["new"]
    return (f"{r['model']}, {r['transport']}: the whole sync (median) {old['median']['whole_s']:.2f} -> "
            f"{new['median']['whole_s']:.2f} s; whole over wire {old['whole_over_wire_median']:.1f}x -> "
            f"{new['whole_over_wire_median']:.2f}x (target {r['target_whole_over_wire']}x)")


def _coordinator(r: dict) -> str:
    sync = r["sync"]
    return (f"quickstart, {r['steps']} steps: sync step median {sync['median_step_s']:.2f} s, the coordinator's own "
            f"share {sync['coordinator_overhead_share']:.1%}; async over sync {r['async_speedup']:.2f}x (rollout and "
            f"training share 2 cores here)")


def _async(r: dict) -> str:
    def speedup(workload: str) -> str:
        return f"{r[workload]['modes']['async k=1']['speedup_vs_sync']:.2f}x"
    multi = r["multi_turn"]["modes"]
    return (f"k = 1 over sync, median step: multi-turn lookup {speedup('multi_turn')} (final reward "
            f"{multi['async k=1']['final_reward']:.2f} vs {multi['sync']['final_reward']:.2f}), quickstart "
            f"{speedup('quickstart')}")


def _lora(r: dict) -> str:
    row = next(x for x in r["results"] if x["model"] == "smollm2" and x["transport"] == "gloo")
    steps = r["step_time_omp1"]["runs"]
    full, lora = steps["full"]["seconds_by_phase"]["step"], steps["lora"]["seconds_by_phase"]["step"]
    return (f"SmolLM2-135M, rank {r['lora']['rank']}, gloo: adapter {row['adapter']['bytes'] / 1e6:.1f} MB in "
            f"{row['adapter']['sync_seconds']:.2f} s vs merged {row['merged']['bytes'] / 1e6:.0f} MB in "
            f"{row['merged']['sync_seconds']:.2f} s; a step with LoRA {lora:.1f} s vs {full:.1f} s without (one thread)")


def _update_memory(r: dict) -> str:
    on, off = r["settings"]["gradient_checkpointing"], r["settings"]["no_gradient_checkpointing"]
    return (f"gradient checkpointing on both sides: {on['rlfabric_mb']:.0f} vs {on['trl_mb']:.0f} MiB "
            f"({on['ratio_rlfabric_over_trl']:.2f}x); off: {off['rlfabric_mb']:.0f} vs {off['trl_mb']:.0f} MiB "
            f"({off['ratio_rlfabric_over_trl']:.2f}x)")


def _load_test(r: dict) -> str:
    def latencies(workload: str) -> str:
        phases = r[workload]["phases"]
        clients = "/".join(str(p["clients"]) for p in phases)
        p50 = "/".join(f"{p['latency_ms']['p50']:.0f}" for p in phases)
        p99 = "/".join(f"{p['latency_ms']['p99']:.0f}" for p in phases)
        return f"{clients} clients: p50 {p50} ms, p99 {p99} ms"
    over = r["reward_score_overload"]["phases"][0]["codes"]
    return (f"Score {latencies('reward_score')}; Generate {latencies('rollout_generate')}; past a limit of 8: "
            f"Score {over['OK']} OK + {over['RESOURCE_EXHAUSTED']} RESOURCE_EXHAUSTED, no other error")


def _weight_sync_delta(r: dict) -> str:
    rates = r["learning_rates"]
    return "; ".join(f"lr {lr}: {row['bytes_ratio']:.3f} of the bytes, {row['time_ratio']:.2f} of the time"
                     for lr, row in rates.items())


ROWS: tuple[tuple[str, str, Callable[[dict], str]], ...] = (
    ("time to the first step, SmolLM2 example, before -> after (medians)", "time_to_first_step.json",
     _time_to_first_step),
    ("tensor codec, encode + decode, float32", "codec.json", _codec),
    ("reward service, GSM8K items", "reward.json", _reward),
    ("generative judge (reward.judge), items/s batched (batch_size 16, max_concurrency 2) vs unbatched (1, 1)",
     "judge.json", _judge),
    ("actor training", "actor.json", _actor),
    ("rollout service overhead", "rollout.json", _rollout),
    ("weight sync against raw loopback TCP", "weight_sync.json", _weight_sync),
    ("weight sync phases, before and after pipelining", "weight_sync_phases.json", _weight_sync_phases),
    ("delta against full weight sync, SmolLM2-135M, bfloat16 replica, grpc", "weight_sync_delta.json",
     _weight_sync_delta),
    ("coordinator loop", "coordinator.json", _coordinator),
    ("async against sync, separate CPU pools", "async.json", _async),
    ("LoRA: adapter against merged sync, step time", "lora.json", _lora),
    ("update memory against TRL's training step, SmolLM2-135M", "update_memory.json", _update_memory),
    ("load: concurrent clients", "load.json", _load_test),
)


def summary_table() -> str:
    lines = ["| benchmark | figures | file |", "| --- | --- | --- |"]
    lines += [f"| {what} | {row(_load(name))} | [`{name}`](bench-results/{name}) |" for what, name, row in ROWS]
    return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if 1e6 <= n < 1e8 else f"{n / 1e6:.0f} MB" if n >= 1e8 else f"{n / 1e3:.0f} KB"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.1 else f"{s:.3f} s"


def lora_sync_table() -> str:
    """docs/generated/lora-sync.md: adapter against merged weight sync, from bench/results/lora.json."""
    names = {"smollm2": "SmolLM2-135M", "tiny": "tiny (quickstart)"}
    lines = ["| model | transport | adapter bytes | merged bytes | adapter sync | merged sync |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in sorted(_load("lora.json")["results"], key=lambda x: (x["model"] != "smollm2", x["transport"])):
        adapter, merged = row["adapter"], row["merged"]
        lines.append(f"| {names.get(row['model'], row['model'])} | {row['transport']} | {_size(adapter['bytes'])} "
                     f"| {_size(merged['bytes'])} ({row['bytes_ratio']}x) | {_seconds(adapter['sync_seconds'])} "
                     f"| {_seconds(merged['sync_seconds'])} ({row['sync_speedup']}x) |")
    return "\n".join(lines) + "\n"


def lora_step_table() -> str:
    """docs/generated/lora-steps.md: a GRPO step with and without LoRA, from bench/results/lora.json."""
    results = _load("lora.json")
    phases = {"step": "step", "gen": "generation (vLLM)", "update": "actor update", "update_weights": "weight sync"}
    lines = ["| phase | full, default threads | LoRA r16 | LoRA / full | full, 1 thread | LoRA r16 | LoRA / full |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for phase, label in phases.items():
        cells = []
        for part in ("step_time", "step_time_omp1"):
            runs = results[part]["runs"]
            full, lora = (runs[kind]["seconds_by_phase"][phase] for kind in ("full", "lora"))
            sizes = [f" ({_size(runs[kind]['sync_bytes'])})" if phase == "update_weights" and part == "step_time"
                     else "" for kind in ("full", "lora")]
            fmt = "{:.2f} s" if phase == "update_weights" else "{:.1f} s"
            cells += [fmt.format(full) + sizes[0], fmt.format(lora) + sizes[1], f"{lora / full:.2f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


ASYNC_WORKLOADS = {
    "multi_turn": "multi_turn: lookup tool calls, a model that learns to call (16 prompts x 8, 3 epochs)",
    "multi_turn_slow": "multi_turn_slow: the same at actor.lr 7e-5",
    "multi_turn_one_epoch": "multi_turn_one_epoch: the lookup example's batch (32 x 8, 1 epoch)",
    "quickstart": "quickstart: one-letter answers",
    "real_model": "real model: SmolLM2-135M, vLLM, arithmetic (8 x 4 x 48 tokens)",
}


def async_table() -> str:
    """docs/generated/async.md: async against sync per workload and staleness k, from bench/results/async.json."""
    results = _load("async.json")
    lines = ["| workload (bound) | mode | median step | vs sync | final reward (last 3 steps) | to reward, vs sync |",
             "| --- | --- | --- | --- | --- | --- |"]
    for workload, what in ASYNC_WORKLOADS.items():
        runs = results[workload]
        label = (f"{what}, {runs['steps']} steps x {runs['rounds']} round(s) "
                 f"(bound {runs['overlap_bound_vs_sync']:.2f}x)")
        for mode, row in runs["modes"].items():
            if mode == "sync":
                reached = (f"{runs['reward_target']} in {row['seconds_to_target']:.1f} s"
                           if row["seconds_to_target"] else f"{runs['reward_target']}: not reached")
            else:
                speedup = row["time_to_target_speedup_vs_sync"]
                reached = f"{speedup:.2f}x" if speedup else "-"
            lines.append(f"| {label} | {mode.replace('k=', 'k = ')} | {row['median_step_s']:.2f} s "
                         f"| {row['speedup_vs_sync']:.2f}x | {row['final_reward']:.2f} | {reached} |")
            label = ""
    return "\n".join(lines) + "\n"


def weight_sync_delta_table() -> str:
    """docs/generated/weight-sync-delta.md: delta against full weight sync per learning rate, from
    bench/results/weight_sync_delta.json."""
    results = _load("weight_sync_delta.json")
    rows = [(f"{lr}, 1 replica", row) for lr, row in results["learning_rates"].items()]
    if "two_replicas" in results:
        rows.append((f"{results['two_replicas']['learning_rate']}, 2 replicas", results["two_replicas"]))
    lines = ["| learning rate | bytes, delta / full | sync, delta / full | actor pack + encode, delta / full "
             "| replica rebuild + switch, delta / full | elements changed by a first AdamW step | bytes: changed "
             "elements / XOR + zstd / best of both |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, row in rows:
        delta, full = row["phases_median"]["delta"], row["phases_median"]["full"]
        encodings = row.get("encodings")
        sizes = encodings["bytes_ratio"] if encodings else None
        lines.append(f"| {label} | {row['bytes_ratio']:.3f} | {_seconds(row['delta_s_median'])} / "
                     f"{_seconds(row['full_s_median'])} = {row['time_ratio']:.2f} | {_seconds(delta['pack'])} / "
                     f"{_seconds(full['pack'])} | {_seconds(delta['apply'])} / {_seconds(full['apply'])} "
                     + (f"| {encodings['changed_fraction']:.3f} | {sizes['sparse']:.3f} / {sizes['xor_zstd']:.3f} "
                        f"/ {sizes['best']:.3f} |" if encodings else "| | |"))
    return "\n".join(lines) + "\n"


def scale_table() -> str:
    """docs/generated/scale.md: the coordinator against N sim replicas per batch (bench/results/scale.json), each
    point beside the reference run's of the same replicas, batch and mode (an earlier commit) where it has one."""
    results = _load("scale.json")
    reference = {(p["replicas"], p["samples"], p["mode"]): p for p in results.get("reference", {}).get("points", [])}
    label = results.get("reference", {}).get("label", "")
    lines = ["| samples (mode) | replicas | coordinator CPU / step | overhead / step | peak RSS | router balance "
             "| load average |", "| --- | --- | --- | --- | --- | --- | --- |"]

    def cell(point: dict, key: str, fmt: str, was: dict | None) -> str:
        return fmt.format(point[key]) + (f" ({fmt.format(was[key])})" if was and key in was else "")

    for p in results["points"]:
        was = reference.get((p["replicas"], p["samples"], p["mode"]))
        lines.append(f"| {p['prompts']} x {p['n']} ({p['mode']}) | {p['replicas']} "
                     f"| {cell(p, 'coordinator_cpu_s_per_step', '{:.1f} s', was)} "
                     f"| {cell(p, 'coordinator_overhead_s_median', '{:.2f} s', was)} "
                     f"| {cell(p, 'coordinator_peak_rss_mb', '{:.0f} MB', was)} | {p['router_balance']:.2f} "
                     f"| {p['load_average'][0]:.0f} |")
    if reference:
        lines.append(f"\nIn brackets: {label}, measured the same way on the same machine.")
    return "\n".join(lines) + "\n"
