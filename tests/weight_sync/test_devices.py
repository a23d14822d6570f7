"""weight_sync.transport auto decides from the physical devices the members hold (fake layouts: what the
services would report on machines this CPU-only host is not), and a forced nccl or cuda_ipc on devices it
cannot run on is refused naming the key."""

from __future__ import annotations

import pytest
import torch

from rlfabric.core.errors import FailedPrecondition
from rlfabric.weight_sync.devices import (
    SAME_DEVICE_TRANSPORT,
    SHARED_GPU_TRANSPORT,
    DeviceReport,
    choose_transport,
    gpu_uuid,
    normalize_uuid,
    report_of,
    visible_gpu_entry,
)

GPU_A = "GPU-8f2c1e4a-0000-4000-8000-00000000000a"
GPU_B = "GPU-8f2c1e4a-0000-4000-8000-00000000000b"
CPU = DeviceReport("cpu")


def on(index: int, uuid: str) -> DeviceReport:
    return DeviceReport(f"cuda:{index}", uuid)


def test_one_gpu_for_everything_takes_the_same_device_path_not_nccl():
    # `rlfabric train` on a one-GPU machine, no pools: actor and rollout both see cuda:0.
    choice = choose_transport("auto", on(0, GPU_A), {"rollout-0": on(0, GPU_A)})
    assert choice.transport == SAME_DEVICE_TRANSPORT == "cuda_ipc"
    assert choice.reason == f"the actor and rollout-0 share GPU {GPU_A}"
    # An SGLang server cannot take CUDA IPC: through host memory instead.
    sglang = choose_transport("auto", on(0, GPU_A), {"rollout-0": on(0, GPU_A)}, cuda_ipc=False)
    assert sglang.transport == SHARED_GPU_TRANSPORT == "gloo" and "SGLang" in sglang.reason


def test_the_same_index_in_two_processes_is_not_the_same_gpu():
    # Each service sees its own GPU as cuda:0 (CUDA_VISIBLE_DEVICES=0 and =1): distinct UUIDs, so NCCL.
    choice = choose_transport("auto", on(0, GPU_A), {"rollout-0": on(0, GPU_B)})
    assert choice.transport == "nccl" and choice.reason == "every member holds a GPU of its own"


def test_different_indices_can_be_one_gpu():
    # The actor sees every GPU and uses cuda:1; the replica runs under CUDA_VISIBLE_DEVICES=1 (cuda:0).
    # torch's UUID has no "GPU-" prefix, NVML's has: the same GPU either way.
    choice = choose_transport("auto", on(1, GPU_B), {"rollout-0": on(0, GPU_B.removeprefix("GPU-").upper())})
    assert choice.transport == SAME_DEVICE_TRANSPORT


def test_two_replicas_on_one_gpu_cannot_share_an_nccl_group_either():
    # ... nor take CUDA IPC from an actor on another GPU: through host memory.
    choice = choose_transport("auto", on(0, GPU_A), {"rollout-0": on(0, GPU_B), "rollout-1": on(0, GPU_B)})
    assert choice.transport == SHARED_GPU_TRANSPORT
    assert choice.reason == f"rollout-0 and rollout-1 share GPU {GPU_B}"
    # The actor's GPU shared by one replica but not the other: gloo too.
    mixed = choose_transport("auto", on(0, GPU_A), {"rollout-0": on(0, GPU_A), "rollout-1": on(0, GPU_B)})
    assert mixed.transport == SHARED_GPU_TRANSPORT


@pytest.mark.parametrize("actor, rollout, who", [(CPU, on(0, GPU_A), "the actor"), (on(0, GPU_A), CPU, "rollout-0")])
def test_a_member_on_cpu_means_gloo(actor, rollout, who):
    choice = choose_transport("auto", actor, {"rollout-0": rollout})
    assert (choice.transport, choice.reason) == ("gloo", f"{who} is on CPU")


def test_a_gpu_nobody_can_name_falls_back_on_the_resource_pools():
    # E.g. an SGLang server: the rollout service cannot tell which GPU it computes on.
    unknown = DeviceReport("cuda:0", "")
    assert choose_transport("auto", on(0, GPU_A), {"rollout-0": unknown}).transport == "nccl"
    shared = choose_transport("auto", on(0, GPU_A), {"rollout-0": unknown}, pools_share_gpus=True)
    assert shared.transport == SHARED_GPU_TRANSPORT and "resource pools" in shared.reason  # CUDA IPC needs the UUID
    # A service that reports nothing (an older one) counts as unknown too.
    assert choose_transport("auto", on(0, GPU_A), {"rollout-0": DeviceReport()}).transport == "nccl"
    # An actor that reports nothing keeps its own default, as before.
    assert choose_transport("auto", DeviceReport(), {"rollout-0": on(0, GPU_A)}).transport == ""


def test_forcing_nccl_onto_one_gpu_is_refused_naming_the_key():
    with pytest.raises(FailedPrecondition, match="weight_sync.transport nccl cannot run on these devices: the actor "
                                                 "and rollout-0 share GPU .*set weight_sync.transport to auto"):
        choose_transport("nccl", on(0, GPU_A), {"rollout-0": on(0, GPU_A)})
    with pytest.raises(FailedPrecondition, match="weight_sync.transport nccl needs every member on a GPU, and "
                                                 "rollout-0 is on CPU"):
        choose_transport("nccl", on(0, GPU_A), {"rollout-0": CPU})
    assert choose_transport("nccl", on(0, GPU_A), {"rollout-0": on(0, GPU_B)}).transport == "nccl"


def test_forcing_cuda_ipc_needs_every_receiver_on_the_actors_gpu():
    assert choose_transport("cuda_ipc", on(0, GPU_A), {"rollout-0": on(1, GPU_A)}).transport == "cuda_ipc"
    with pytest.raises(FailedPrecondition, match="weight_sync.transport cuda_ipc needs every receiver on the actor's "
                                                 "GPU, and rollout-1 is on cuda:0 GPU-.*b, not on the actor's GPU"):
        choose_transport("cuda_ipc", on(0, GPU_A), {"rollout-0": on(0, GPU_A), "rollout-1": on(0, GPU_B)})
    for receiver in (CPU, DeviceReport("cuda:0", "")):
        with pytest.raises(FailedPrecondition, match="weight_sync.transport cuda_ipc"):
            choose_transport("cuda_ipc", on(0, GPU_A), {"rollout-0": receiver})
    with pytest.raises(FailedPrecondition, match="the actor's GPU is unknown"):
        choose_transport("cuda_ipc", CPU, {"rollout-0": on(0, GPU_A)})


@pytest.mark.parametrize("configured", ["gloo", "grpc"])
def test_gloo_and_grpc_run_anywhere_and_are_kept(configured):
    assert choose_transport(configured, on(0, GPU_A), {"rollout-0": on(0, GPU_A)}).transport == configured


def test_a_report_survives_the_wire():
    report = on(3, GPU_A)
    assert DeviceReport.from_proto(report.to_proto()) == report
    assert normalize_uuid("MIG-ABC") == normalize_uuid("abc") == "abc"


@pytest.mark.parametrize("index, visible, entry", [
    (0, None, "0"), (1, None, "1"),  # unset: every GPU, in order
    (0, "2,3", "2"), (1, " 2, 3 ", "3"),
    (0, "GPU-8f2c,GPU-9a00", "GPU-8f2c"),  # UUID (prefixes) as entries
])
def test_a_cuda_index_is_read_through_cuda_visible_devices(index, visible, entry):
    assert visible_gpu_entry(index, visible) == entry


def test_an_index_beyond_the_visible_gpus_is_an_error():
    with pytest.raises(ValueError, match="CUDA device 2 is not visible"):
        visible_gpu_entry(2, "0,1")


def test_this_process_reports_its_own_device():
    assert report_of(torch.device("cpu")) == CPU
    if torch.cuda.is_available():  # a GPU machine (make gpu-check): a real UUID, the same by torch or NVML
        report = report_of(torch.device("cuda", 0))
        assert report.device == "cuda:0" and report.uuid.startswith("GPU-") and len(report.gpu) == 36
        nvml = gpu_uuid(0, init_cuda=False)
        assert nvml in ("", report.uuid)  # "" where pynvml is not installed
