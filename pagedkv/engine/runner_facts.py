"""What an engine's model runner (or rank 0 of its tensor-parallel executor) is, as
`EngineReady`'s descriptive fields: the weights' dtype and bytes, the device, and what runs the
CPU model's hot ops. Read once, when the core is built, for the server's start-up banner."""

from __future__ import annotations

from typing import Any


def runner_facts(runner: Any) -> dict[str, Any]:
    """`EngineReady` keyword arguments describing `runner` (a part it lacks stays empty)."""
    device = getattr(runner, "device", None)
    facts: dict[str, Any] = {
        "model_dtype": str(getattr(runner, "dtype", "")).removeprefix("torch."),
        "weights_bytes": int(getattr(runner, "weights_bytes", 0) or 0),
        "device": "" if device is None else str(device),
        "cpu_kernels": ""}
    if getattr(device, "type", None) == "cpu":
        from pagedkv.kernels.choice import describe_choice
        from pagedkv.kernels.cpu import cpu_kernels_loaded, kernels_in_use

        facts["cpu_kernels"] = kernels_in_use(getattr(runner, "cpu_kernels", "off"))
        if cpu_kernels_loaded() and getattr(runner, "cpu_kernels", "off") != "off":
            facts["cpu_kernels"] += f"; {describe_choice()}"
    return facts
