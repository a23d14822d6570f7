"""Which physical device each member of a weight-sync group holds, and the transport that follows.

    actor = DeviceReport("cuda:0", "GPU-8f2c...")                  # what the actor's GetStatus reports
    choice = choose_transport("auto", actor, {"rollout-0": DeviceReport("cuda:0", "GPU-8f2c...")})
    choice.transport, choice.reason     # "cuda_ipc", "the actor and rollout-0 share GPU GPU-8f2c..."

weight_sync.transport auto decides from the devices the members really hold, not from how the run was
configured: every service reports the device its weights live on and that GPU's UUID (CUDA_VISIBLE_DEVICES
and the device index resolved to the physical GPU, so two processes that both say cuda:0 are told apart):
- the actor or a receiver on CPU: gloo (NCCL needs a GPU on every rank);
- every receiver on the actor's own GPU (colocated roles, one GPU for everything): the same-device transport,
  cuda_ipc (the actor lends its buckets' GPU memory; rlfabric.weight_sync.cuda_ipc), unless a receiver cannot
  take it (an SGLang server: gloo). NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
  detected"), so it is never nccl;
- two members sharing a GPU otherwise (two replicas on one GPU, the actor on another): gloo;
- every member on a GPU of its own: nccl;
- a member on a GPU whose UUID it cannot tell (an older service, an engine in a process of its own that did
  not say): the run's resource pools decide, as before (a pool with GPUs shared with the actor: gloo, as CUDA IPC
  needs the GPU's identity to be known).
weight_sync.transport nccl on devices NCCL cannot join, and cuda_ipc where a receiver is not on the actor's GPU,
are refused with a message naming the key.

The launchers (rlfabric.launch) and the Helm chart predict the same decision from what they place, where
they can tell, and refuse a forced nccl before anything starts; the coordinator decides from the reports.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rlfabric.core.errors import FailedPrecondition
from rlfabric.v1 import weight_sync_pb2

# The transport when every receiver is on the actor's GPU: the actor lends its buckets on the device itself.
SAME_DEVICE_TRANSPORT = "cuda_ipc"
# Where GPUs are shared otherwise, or CUDA IPC cannot be used: through host memory.
SHARED_GPU_TRANSPORT = "gloo"


@dataclass(frozen=True)
class DeviceReport:
    """Where one member's weights live: device "cpu" or "cuda:N" ("" = not reported), and for a GPU its UUID
    ("" = unknown). Launchers predicting a placement put any identity that is equal exactly when the GPU is."""

    device: str = ""
    uuid: str = ""

    def to_proto(self) -> weight_sync_pb2.WeightSyncDevice:
        return weight_sync_pb2.WeightSyncDevice(device=self.device, uuid=self.uuid)

    @classmethod
    def from_proto(cls, message: weight_sync_pb2.WeightSyncDevice) -> DeviceReport:
        return cls(message.device, message.uuid)

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def gpu(self) -> str:
        """The physical GPU's identity, "" when not on a GPU or unknown."""
        return normalize_uuid(self.uuid) if self.device.startswith("cuda") else ""


@dataclass(frozen=True)
class TransportChoice:
    transport: str  # "nccl" | "gloo" | "grpc"; "" = the actor's own default
    reason: str


def normalize_uuid(uuid: str) -> str:
    """NVML writes "GPU-8f2c...", torch's device properties "8f2c...": one form for comparing."""
    uuid = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            return uuid[len(prefix):]
    return uuid


def choose_transport(configured: str, actor: DeviceReport, receivers: Mapping[str, DeviceReport],
                     pools_share_gpus: bool = False, cuda_ipc: bool = True) -> TransportChoice:
    """The transport of a group of the actor (rank 0) and `receivers` for weight_sync.transport `configured`.
    pools_share_gpus: the run's resource pools put the actor and the rollout on shared GPUs (only used for
    members whose GPU is unknown). cuda_ipc: every receiver can take buckets by CUDA IPC (not an SGLang
    server). FailedPrecondition when `configured` is nccl or cuda_ipc and these devices cannot run it."""
    members = {"the actor": actor, **receivers}
    on_cpu = [name for name, report in members.items() if report.on_cpu]
    shared = _sharing(members)
    unknown = [name for name, report in members.items() if not report.on_cpu and not report.gpu]
    elsewhere = [name for name, report in receivers.items() if not actor.gpu or report.gpu != actor.gpu]
    if configured == "cuda_ipc":
        if elsewhere or not receivers:
            where = f"the actor's GPU is unknown ({actor.device or 'not reported'})" if not actor.gpu else (
                f"{elsewhere[0]} is on {receivers[elsewhere[0]].device or 'an unknown device'} "
                f"{receivers[elsewhere[0]].uuid}, not on the actor's GPU {actor.uuid}")
            raise FailedPrecondition(f"weight_sync.transport cuda_ipc needs every receiver on the actor's GPU, and "
                                     f"{where}: set weight_sync.transport to auto")
        return TransportChoice("cuda_ipc", "weight_sync.transport cuda_ipc")
    if configured == "nccl":
        if on_cpu:
            raise FailedPrecondition(f"weight_sync.transport nccl needs every member on a GPU, and {on_cpu[0]} is "
                                     "on CPU: set weight_sync.transport to auto, gloo or grpc")
        if shared:
            raise FailedPrecondition(f"weight_sync.transport nccl cannot run on these devices: {shared} (NCCL "
                                     "refuses two ranks on one GPU): set weight_sync.transport to auto or gloo")
        return TransportChoice("nccl", "weight_sync.transport nccl")
    if configured != "auto":
        return TransportChoice(configured, f"weight_sync.transport {configured}")
    if on_cpu:
        return TransportChoice("gloo", f"{on_cpu[0]} is on CPU")
    if shared and not elsewhere and receivers:
        if cuda_ipc:
            return TransportChoice(SAME_DEVICE_TRANSPORT, shared)
        return TransportChoice(SHARED_GPU_TRANSPORT, f"{shared}; a receiver cannot take CUDA IPC (SGLang)")
    if shared:
        return TransportChoice(SHARED_GPU_TRANSPORT, shared)
    if not actor.device:  # an actor that does not report: its own default (nccl on a GPU), as before
        return TransportChoice(SHARED_GPU_TRANSPORT if pools_share_gpus else "",
                               "the actor did not report its device" + (
                                   "; the resource pools put it on the rollout's GPUs" if pools_share_gpus else ""))
    if unknown:
        if pools_share_gpus:
            return TransportChoice(SHARED_GPU_TRANSPORT, f"{unknown[0]} did not report its GPU and the resource "
                                                         "pools put the actor and the rollout on the same GPUs")
        return TransportChoice("nccl", f"{unknown[0]} did not report its GPU; the resource pools keep them apart")
    return TransportChoice("nccl", "every member holds a GPU of its own")


def _sharing(members: Mapping[str, DeviceReport]) -> str:
    """"" or which two members share a GPU, in words."""
    holder: dict[str, str] = {}
    for name, report in members.items():
        gpu = report.gpu
        if gpu and gpu in holder:
            return f"{holder[gpu]} and {name} share GPU {report.uuid}"
        if gpu:
            holder[gpu] = name
    return ""


# -- what a process reports --------------------------------------------------------------------------------


def visible_gpu_entry(index: int, visible: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES entry that CUDA device `index` of a process is: an NVML index ("3") or a UUID
    (prefix, "GPU-8f2c"); str(index) when the variable is unset (every GPU visible)."""
    if visible is None:
        return str(index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if index >= len(entries):
        raise ValueError(f"CUDA device {index} is not visible (CUDA_VISIBLE_DEVICES={visible!r})")
    return entries[index]


def gpu_uuid(index: int, init_cuda: bool = True) -> str:
    """The UUID of this process's CUDA device `index`; "" when it cannot tell. init_cuda: torch may create
    this process's CUDA context to ask (a torch engine on that GPU makes one anyway); otherwise only NVML
    (pynvml, which vLLM installs) is asked, so a process whose GPU work runs elsewhere holds no context."""
    import torch

    if init_cuda or torch.cuda.is_initialized():
        try:
            return "GPU-" + str(torch.cuda.get_device_properties(index).uuid)
        except (RuntimeError, AssertionError, AttributeError):
            return ""
    return _nvml_uuid(visible_gpu_entry(index, os.environ.get("CUDA_VISIBLE_DEVICES")))


def _nvml_uuid(entry: str) -> str:
    """NVML's UUID of a CUDA_VISIBLE_DEVICES entry. Integer entries are NVML (PCI bus) indices, which are
    CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID and on machines of one GPU model."""
    try:
        import pynvml
    except ImportError:
        return ""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return ""
    try:
        if entry.isdigit():
            return _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(int(entry))))
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)))
            if uuid.startswith(entry):
                return uuid
        return ""
    except pynvml.NVMLError:
        return ""
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def report_of(device, init_cuda: bool = True) -> DeviceReport:
    """The DeviceReport of a torch.device this process computes on (index None = the current device)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return DeviceReport(device.type)
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    return DeviceReport(f"cuda:{index}", gpu_uuid(index, init_cuda))
