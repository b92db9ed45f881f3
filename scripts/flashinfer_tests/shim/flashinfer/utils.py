"""The flashinfer.utils helpers FlashInfer's tests call (shim: scripts/flashinfer_tests)."""

import torch


def get_compute_capability(device) -> tuple[int, int]:
    """(major, minor); (0, 0) without a GPU (the test files are then only collected)."""
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else (0, 0)


def has_flashinfer_jit_cache() -> bool:
    """True: the tests' warm-up fixtures (FlashInfer's JIT builds) are not needed here."""
    return True


def is_sm90a_supported(device) -> bool:
    return get_compute_capability(device)[0] == 9


def is_sm100a_supported(device) -> bool:
    return get_compute_capability(device)[0] == 10


class GPUArchitectureError(Exception):
    """FlashInfer's error for a kernel its GPU cannot run (its test helpers import it)."""
