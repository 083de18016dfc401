"""What an engine's model runner (or rank 0 of its tensor-parallel executor) is, as
`EngineReady`'s descriptive fields: the weights' dtype and bytes, the device, and what runs the
CPU model's hot ops. Read once, when the core is built, for the server's start-up banner; and
the CPU kernels' choice as it stands (`kernel_choice`: the prefill attention's is made at the
first prefill), the core's utility call "cpu_kernel_choice" for /kv_cache_info."""

from __future__ import annotations

from typing import Any


def runner_facts(runner: Any) -> dict[str, Any]:
    """`EngineReady` keyword arguments describing `runner` (a part it lacks stays empty)."""
    device = getattr(runner, "device", None)
    facts: dict[str, Any] = {
        "model_dtype": str(getattr(runner, "dtype", "")).removeprefix("torch."),
        "weights_bytes": int(getattr(runner, "weights_bytes", 0) or 0),
        "device": "" if device is None else str(device),
        "cpu_kernels": "", "malloc": ""}
    if getattr(device, "type", None) == "cpu":
        from pagedkv.kernels.choice import describe_choice
        from pagedkv.kernels.cpu import cpu_kernels_loaded, kernels_in_use
        from pagedkv.model.cpu_memory import malloc_in_use

        facts["malloc"] = malloc_in_use()

        facts["cpu_kernels"] = kernels_in_use(getattr(runner, "cpu_kernels", "off"))
        if cpu_kernels_loaded() and getattr(runner, "cpu_kernels", "off") != "off":
            facts["cpu_kernels"] += (f"; {describe_choice()}; {_decode_choice(runner)}"
                                     f"{_amx_prefill(runner)}")
    return facts


def _amx_prefill(runner: Any) -> str:
    """"; fresh prompts' attention: ..." where the runner's fresh prompts run the AMX kernel."""
    from pagedkv.model.decode_choice import runner_class
    from pagedkv.model.prefill_choice import describe_amx

    cls = runner_class(runner)
    return "" if cls is None else describe_amx(cls.dtype, cls.head_dim)


def _decode_choice(runner: Any) -> str:
    """The decode attention's choice in words, made now where the runner's class is known
    (else at the first decode)."""
    from pagedkv.model.decode_choice import decode_table, describe_decode, runner_class

    cls = runner_class(runner)
    if cls is not None:
        decode_table(cls)
    return describe_decode()


def kernel_choice(runner: Any) -> dict[str, Any] | None:
    """The CPU kernels' choice of `runner` so far, JSON-able (None where no fused CPU kernel
    runs: another device, cpu_kernels "off", or the kernels not loaded yet): the choice mode
    (PAGEDKV_KERNEL_CHOICE), the loaded build's panel ISA, each linear shape class's kernel per
    rows bucket, each prefill attention class's lengths from which torch's attention runs
    (fresh chunks, chunks after a cached prefix) and each decode attention class's kernels."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) != "cpu" or getattr(runner, "cpu_kernels", "off") == "off":
        return None
    from pagedkv.kernels.choice import choice_mode, linears_in_use
    from pagedkv.kernels.cpu import cpu_kernels_loaded, panel_isa
    from pagedkv.model.decode_choice import decode_in_use
    from pagedkv.model.prefill_choice import prefill_in_use

    if not cpu_kernels_loaded():
        return None
    return {"mode": choice_mode(), "isa": panel_isa(), "linears": linears_in_use(),
            "prefill_attention": {cls: start.as_json()
                                  for cls, start in prefill_in_use().items()},
            "decode_attention": decode_in_use()}
