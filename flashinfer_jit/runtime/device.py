"""What the host code of every attention family (decode; prefill and POD next) asks about a
device, and the small per-device objects it keeps.

Facts that cannot change in a process are cached per device (functools.cache): plan()
reads them per configuration, run() at every call. Nothing here runs at import.
"""

from __future__ import annotations

import functools
import threading

import torch


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The SM count a plan assumes off a CUDA device (a CPU workspace: tests and host benchmarks
# plan without a GPU): the H100 SXM's, so that their plans are the ones an H100 makes.
CPU_SMS = 132


def sm_count(device: torch.device) -> int:
    """SMs of the device a wrapper plans for (its workspace's); CPU_SMS off CUDA."""
    return num_sms(device.index or 0) if device.type == "cuda" else CPU_SMS


@functools.cache
def peak_dram_bytes_per_s(device: torch.device) -> float | None:
    """A CUDA device's DRAM peak, 2 x memory clock x bus width (H100 SXM: 3.35e12, H200:
    4.9e12), or None (not a CUDA device, or torch does not report them)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device.index or 0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


@functools.cache
def sm90_or_later(device) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def supports_pdl(device) -> bool:
    """Whether kernels on `device` can be programmatic dependent launches (sm_90 and
    later): FlashInfer's default for enable_pdl=None."""
    return sm90_or_later(device)


def supports_clusters(device) -> bool:
    """Whether `device` runs thread-block clusters (sm_90 and later)."""
    return sm90_or_later(device)


def _no_cuda_streams(device_index: int) -> int:
    raise RuntimeError("this torch has no CUDA streams (a CPU build)")


# raw_stream(device_index): the current stream of a CUDA device as the address a C entry
# point takes. torch's own function, not a wrapper around it: run()'s fast paths call it
# every launch, and a Python frame costs ~0.1 us.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda_streams)


@functools.cache
def placeholder(device, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of `dtype` on `device`, kept: what an op gets for an optional tensor
    or an output not asked for (it takes a tensor either way)."""
    return torch.empty(0, dtype=dtype, device=device)


@functools.cache
def single_workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    """The workspace a single-request function (single_decode_with_kv_cache,
    single_prefill_with_kv_cache) plans its wrapper with, one per device and size: their
    runs are ordered on the caller's stream, as FlashInfer's shared workspace is."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def empty_f32(device) -> torch.Tensor:
    return placeholder(device, torch.float32)


def new_event(device: torch.device):
    """A CUDA event of `device` whose record() takes the stream in C++ (torch.Event):
    torch.cuda.Event.record() first builds the current stream in Python, 4 of its 5 us
    on the GPU host. (The fallback, for a torch without torch.Event, records on the
    current device's stream.)"""
    return torch.Event(device=device) if hasattr(torch, "Event") else torch.cuda.Event()


def outside_graph_pool(fn, device: torch.device):
    """fn() in a helper thread on the caller's current stream (so in stream order): its
    allocations, which outlive the call (a planned wrapper's buffers, kept placeholders),
    then stay out of a CUDA-graph memory pool that routes the calling thread's allocations
    (torch.compile's reduce-overhead warm-up and recording would count them as live
    allocations it does not track: "All live allocations must be tracked"). Exceptions
    reach the caller. Off CUDA, fn() here."""
    if device.type != "cuda":
        return fn()
    stream = torch.cuda.current_stream(device)
    result, error = [], []

    def target():
        try:
            with torch.cuda.stream(stream):
                result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="flashinfer_jit-plan")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def keep_plan(plans: dict, key, wrapper, most: int) -> None:
    """The single-request functions' plans, kept by configuration and length: `wrapper` under
    `key` (None: not kept), the oldest one dropped past `most`."""
    if key is None:
        return
    if len(plans) >= most:
        plans.pop(next(iter(plans)))
    plans[key] = wrapper
