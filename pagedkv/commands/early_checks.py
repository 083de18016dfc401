"""What the command line can tell before torch loads: a CUDA device asked for where no GPU
driver exists, a KV cache larger than a CPU machine's memory, a model directory whose
config.json names an architecture the registry does not run. Each is a ValueError naming the
flag or the value, answered in well under a second; the engine checks the same again (with
torch, against the GPU's memory on CUDA, and a GGUF file's architecture) when it starts."""

from __future__ import annotations

import json
from pathlib import Path

from pagedkv.engine.args import EngineArgs
from pagedkv.model.registry_names import resolve_architecture

# Device nodes of a GPU driver torch's "cuda" device could use: NVIDIA's, ROCm's, WSL2's.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def gpu_driver_present(paths: tuple[str, ...] = GPU_DRIVER_PATHS) -> bool:
    """Whether any GPU driver's device node exists (without it torch finds no CUDA device)."""
    return any(Path(path).exists() for path in paths)


def check_machine(args: EngineArgs, paths: tuple[str, ...] = GPU_DRIVER_PATHS) -> None:
    """ValueError naming the flag for a CUDA device on a machine with no GPU driver, or a
    --kv-cache-memory-bytes larger than the memory of a machine that will run on its CPU."""
    gpu = gpu_driver_present(paths)
    device = str(args.device)
    if device.startswith("cuda") and not gpu:
        raise ValueError(f"device {device!r} (--device): CUDA is not available (no GPU driver "
                         "on this machine); use --device cpu or auto")
    on_cpu = device == "cpu" or (device == "auto" and not gpu)
    if on_cpu and args.kv_cache_memory_bytes is not None:
        from pagedkv.engine.kv_setup import check_fits_in_memory, host_memory_bytes

        if args.kv_cache_memory_bytes > host_memory_bytes()[0]:  # raises, naming the flag
            check_fits_in_memory(args, args.kv_cache_memory_bytes, 0, cuda=False)


def check_architecture(model: str) -> None:
    """ValueError naming the architecture when `model` is a directory whose config.json names
    none the registry runs (a GPT-2 checkpoint, say); anything else is the loader's to judge."""
    config = Path(model) / "config.json"
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(architectures, list):
        resolve_architecture(architectures)


def check_before_loading(args: EngineArgs) -> None:
    """Every check above for the engine `args` describe (run by serve, generate and profile
    on the machine that will load the model: the flags alone are checked apart, so that a
    GPU machine's flags can be checked anywhere)."""
    check_machine(args)
    check_architecture(args.model)
