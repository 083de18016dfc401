"""Load safetensors weights from a Hugging Face model directory (single file or sharded), or a
GGUF file's weights (dequantized; pagedkv.model.gguf), through the same calls.

Never touches the network. Errors name the missing file, shard or tensor, the unreadable
(truncated, garbage) weight file, or the tensor whose shape disagrees with the config. The
config is checked against the checkpoint's headers (layer count, embedding shape) before any
weight memory is allocated, so a config claiming 10^9 layers fails at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagedkv.model.config import ModelConfig
from pagedkv.model.config_files import load_hf_config
from pagedkv.model.gguf import SUFFIX as GGUF_SUFFIX
from pagedkv.model.gguf import gguf_file
from pagedkv.model.json_files import read_json
from pagedkv.model.layers import RotaryEmbedding, rope_inv_freq
from pagedkv.model.parallel.group import TensorParallelGroup
from pagedkv.model.quant.prequantized import (
    DequantizedState,
    PrequantizedFormat,
    method_named,
    prequantized_format,
)
from pagedkv.model.registry import CausalLM, get_model_class, resolve_architecture


def weight_files(model_dir: str | Path) -> list[Path]:
    """The weight files of `model_dir`: a GGUF model's one file (pagedkv.model.gguf.gguf_file);
    else the shards listed in model.safetensors.index.json, else model.safetensors, else every
    *.safetensors file (sorted)."""
    gguf = gguf_file(model_dir)
    if gguf is not None:
        return [gguf]
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"malformed shard index {index}: {e!r}") from e
        shards = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(s) for s in shards if not s.is_file()]
        if missing:
            raise ValueError(f"missing weight shard(s) listed in {index.name}: {', '.join(missing)}")
        return shards
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {model_dir}")
    return files


@contextmanager
def open_weights(path: Path) -> Iterator[Any]:
    """`safe_open(path)`; a truncated or garbage file is a ValueError naming it. A .gguf file
    opens as the same kind of object (pagedkv.model.gguf.tensors.GGUFCheckpoint: Hugging Face
    names, dequantized float32 tensors)."""
    if path.suffix.lower() == GGUF_SUFFIX:
        from pagedkv.model.gguf.file import open_gguf
        from pagedkv.model.gguf.tensors import GGUFCheckpoint

        yield GGUFCheckpoint(open_gguf(path))
        return
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as exc:
        raise ValueError(f"cannot read weights file {path}: {exc}") from None


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every weight file of `model_dir`."""
    for path in weight_files(model_dir):
        with open_weights(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EMBED = "model.embed_tokens.weight"


def check_checkpoint_matches(model_dir: str | Path, num_layers: object, vocab_size: object,
                             hidden_size: object) -> None:
    """Compare config.json's sizes with the checkpoint's headers (no tensor is read): the
    number of layers and the embedding's [vocab_size, hidden_size]. ValueError naming the
    mismatch. Call it before anything is built or allocated from those sizes."""
    check_architecture_supported(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(model_dir):
        with open_weights(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER_RE.match(name))}
    if len(layers) != num_layers:
        raise ValueError(f"the config says num_hidden_layers={num_layers!r} but the "
                         f"weights in {model_dir} hold {len(layers)} layers")
    embed = shapes.get(_EMBED)
    if embed is not None and embed != (vocab_size, hidden_size):
        raise ValueError(f"the config says vocab_size={vocab_size!r}, hidden_size="
                         f"{hidden_size!r} but {_EMBED} in {model_dir} has shape {list(embed)}")


# Older GPTQ and AWQ folders give their settings in a file of their own instead of
# config.json's quantization_config (AutoGPTQ's quantize_config.json, AutoAWQ's
# quant_config.json; vLLM's GPTQ reads the first, its AWQ either): file name -> the method it
# implies when its keys do not say (a `quant_method`, or AutoAWQ's own key names).
QUANT_CONFIG_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
AWQ_KEYS = frozenset({"w_bit", "q_group_size", "zero_point", "version"})


def prequantized(model: str | Path) -> PrequantizedFormat | None:
    """How `model` says its linears are stored pre-quantized (GPTQ, AWQ:
    pagedkv.model.quant.prequantized): config.json's `quantization_config`, else an older
    folder's own file (QUANT_CONFIG_FILES); None for a float checkpoint or a GGUF file.
    ValueError naming a method or layout pagedkv does not read."""
    path = Path(model) / "config.json"
    if gguf_file(model) is not None or not path.is_file():
        return None
    config = read_json(path)
    if not config.get("quantization_config"):
        for name, method in QUANT_CONFIG_FILES.items():
            if (Path(model) / name).is_file():
                settings = read_json(Path(model) / name)
                if AWQ_KEYS & settings.keys():
                    method = "awq"
                config = {"quantization_config": {"quant_method": method, **settings}}
                break
    return prequantized_format(config, model)


def check_architecture_supported(model: str | Path) -> None:
    """ValueError when `model`'s architecture (config.json's `architectures`, a GGUF file's
    `general.architecture`) is not one the registry runs, when it declares a pre-quantized
    checkpoint in a format pagedkv does not read (`prequantized`), or when a GGUF tensor's
    quantization type cannot be dequantized: said before any size is compared or allocated."""
    gguf = gguf_file(model)
    if gguf is not None:
        from pagedkv.model.gguf.config import check_architecture
        from pagedkv.model.gguf.file import open_gguf
        from pagedkv.model.gguf.tensors import check_types

        check_architecture(open_gguf(gguf))
        check_types(open_gguf(gguf))
        return
    path = Path(model) / "config.json"
    if path.is_file():
        resolve_architecture(read_json(path).get("architectures") or [])
        prequantized(model)


def check_model_dir(model_dir: str | Path) -> None:
    """`check_checkpoint_matches` with the sizes the config gives (read raw, before any
    per-layer structure is built from them). ValueError for a path that does not exist."""
    if not Path(model_dir).exists():
        raise ValueError(f"model directory not found: {model_dir}")
    check_architecture_supported(model_dir)
    raw = load_hf_config(model_dir) if gguf_file(model_dir) is not None \
        else read_json(Path(model_dir) / "config.json")
    check_checkpoint_matches(model_dir, raw.get("num_hidden_layers"), raw.get("vocab_size"),
                             raw.get("hidden_size"))


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of `model_dir`'s weights, by name, on CPU in the stored dtype."""
    return dict(iter_tensors(model_dir))


class LazyState:
    """`load_state_dict` read on demand: each tensor when it is asked for (a GGUF tensor is
    dequantized only then), the weight files open meanwhile; the stored tensors as they are
    (a GPTQ / AWQ checkpoint's packed ones too: `checkpoint_state` shows them dequantized)."""

    def __init__(self, model_dir: str | Path, stack: ExitStack) -> None:
        self._files: dict[str, Any] = {}
        for path in weight_files(model_dir):
            f = stack.enter_context(open_weights(path))
            self._files.update(dict.fromkeys(f.keys(), f))

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._files[name].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[name].get_slice(name).get_shape())


def checkpoint_state(model_dir: str | Path, stack: ExitStack) -> LazyState | DequantizedState:
    """`model_dir`'s tensors read on demand (files open until `stack` closes), a GPTQ / AWQ
    checkpoint's quantized linears shown as float32 `X.weight`s dequantized when read."""
    state = LazyState(model_dir, stack)
    fmt = prequantized(model_dir)
    if fmt is None:
        return state
    dequantized = DequantizedState(state, fmt)
    if not dequantized.quantized:
        raise ValueError(f"{model_dir}: config.json declares {method_named(fmt.method)} checkpoint, "
                         f"but its weights hold no quantized linear (no '*.qweight' tensor)")
    return dequantized


def load_weights(module: torch.nn.Module, model_dir: str | Path,
                 preloaded: frozenset[str] = frozenset()) -> None:
    """Copy `model_dir`'s weights into `module` (mutates its parameters in place).

    `module.checkpoint_mapping()` maps each parameter name to the checkpoint tensor names it
    is built from (several names are concatenated along dim 0, e.g. q/k/v into qkv). A
    tensor-parallel shard (`checkpoint_shards` not None) reads only its slice of each tensor
    from the safetensors files. `preloaded`: mapped names whose modules were already built from
    the checkpoint (packed weights, pagedkv.model.quant): neither read nor required as
    parameters. Raises ValueError naming a missing tensor or one whose shape differs from the
    parameter's.
    """
    shards_of = getattr(module, "checkpoint_shards", None)
    if shards_of is None or shards_of("embed_tokens.weight") is None:
        with ExitStack() as stack:
            return _load_whole(module, model_dir, checkpoint_state(model_dir, stack), preloaded)
    _load_sharded(module, model_dir, shards_of)


def _load_whole(module: torch.nn.Module, model_dir: str | Path,
                state: LazyState | DequantizedState, preloaded: frozenset[str]) -> None:
    params = dict(module.named_parameters())
    mapping = {name: sources for name, sources in module.checkpoint_mapping().items()
               if name not in preloaded}
    packed_modules = {name.rpartition(".")[0] for name in preloaded}
    unmapped = sorted(p for p in set(params) - set(mapping)
                      if not _in_packed_module(p, packed_modules))
    if unmapped:  # a model definition bug, not a checkpoint problem
        raise RuntimeError(f"parameters with no checkpoint tensor: {unmapped}")
    for param_name, sources in mapping.items():
        missing = [s for s in sources if s not in state]
        if missing:
            raise ValueError(f"missing tensor {missing[0]!r} in the weights of {model_dir}")
        param = params[param_name]
        expected = _expected_source_shapes(param.shape, sources, module, param_name)
        for src, shape in zip(sources, expected, strict=True):
            got = state.shape(src)
            if got != shape:
                raise ValueError(f"wrong shape for tensor {src!r}: expected {shape}, "
                                 f"got {got}")
        value = torch.cat([state[s] for s in sources], dim=0) if len(sources) > 1 \
            else state[sources[0]]
        with torch.no_grad():
            param.copy_(value.to(param.dtype))


def _in_packed_module(param_name: str, packed_modules: set[str]) -> bool:
    """Whether parameter `param_name` belongs to one of `packed_modules` or to a submodule of
    one (a PartsLinear's parts)."""
    module = param_name.rpartition(".")[0]
    while module:
        if module in packed_modules:
            return True
        module = module.rpartition(".")[0]
    return False


def _load_sharded(module: torch.nn.Module, model_dir: str | Path, shards_of: Any) -> None:
    """Each parameter from its checkpoint tensors' slices (parallel/sharding.py); rows of a
    vocabulary-padded parameter past the checkpoint's stay zero."""
    files: dict[str, Path] = {}
    for path in weight_files(model_dir):
        with open_weights(path) as f:
            files.update(dict.fromkeys(f.keys(), path))
    params = dict(module.named_parameters())
    mapping = module.checkpoint_mapping()
    unmapped = sorted(set(params) - set(mapping))
    if unmapped:
        raise RuntimeError(f"parameters with no checkpoint tensor: {unmapped}")
    for param_name, sources in mapping.items():
        missing = [s for s in sources if s not in files]
        if missing:
            raise ValueError(f"missing tensor {missing[0]!r} in the weights of {model_dir}")
        parts = [_read_shard(files[src], src, shard)
                 for src, shard in zip(sources, shards_of(param_name), strict=True)]
        value = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        param = params[param_name]
        if value.shape[1:] != param.shape[1:] or value.shape[0] > param.shape[0] or (
                value.shape[0] < param.shape[0] and "embed" not in param_name
                and "lm_head" not in param_name):
            raise ValueError(f"wrong shape for tensor(s) {sources!r}: this rank's slice is "
                             f"{tuple(value.shape)}, the parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.zero_()
            param[: value.shape[0]].copy_(value.to(param.dtype))


def _read_shard(path: Path, name: str, shard: Any) -> torch.Tensor:
    """Tensor `name` of `path`, or only `shard`'s slice of it (read from the file as a slice)."""
    with open_weights(path) as f:
        if shard is None:
            return f.get_tensor(name)
        sl = f.get_slice(name)
        shape = list(sl.get_shape())
        if shard.stop > shape[shard.dim]:
            raise ValueError(f"wrong shape for tensor {name!r}: {shape} has no rows "
                             f"[{shard.start}, {shard.stop}) in dim {shard.dim}")
        if shard.zero:
            shape[shard.dim] = shard.stop - shard.start
            return torch.zeros(shape)
        index = (slice(None),) * shard.dim + (slice(shard.start, shard.stop),)
        return sl[index]


def _expected_source_shapes(shape: torch.Size, sources: list[str], module: torch.nn.Module,
                            param_name: str) -> list[tuple[int, ...]]:
    splits = module.checkpoint_splits(param_name) if len(sources) > 1 else [shape[0]]
    return [(n, *shape[1:]) for n in splits]


def _gguf_rope_factors(model: str | Path) -> torch.Tensor | None:
    gguf = gguf_file(model)
    if gguf is None:
        return None
    from pagedkv.model.gguf.file import open_gguf
    from pagedkv.model.gguf.tensors import rope_factors

    return rope_factors(open_gguf(gguf))


def load_model(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
               device: torch.device, tp: TensorParallelGroup | None = None,
               quantization: str = "auto") -> CausalLM:
    """Build the model for `config` on `device` in `dtype` and load `model_dir`'s weights (the
    runner then prepares the projection weights for its CPU path: layers.Linear.pack). With
    `tp`, only this rank's shard is built and read. `quantization` (pagedkv.model.quant.apply):
    on a CPU without `tp`, "auto" keeps a GGUF file's 4-bit linears, and a GPTQ or AWQ
    checkpoint's 4-bit ones, packed when `dtype` is 16-bit (float32 keeps the exact
    dequantized weights: the int4 kernel computes on bfloat16 activations, and is 10-60x slower
    on float32 ones), "gptq" and "awq" are "auto" for a checkpoint of that method (a
    ValueError for any other), "int8" quantizes every other linear per channel, "none" keeps
    every weight in `dtype`; elsewhere "auto" dequantizes and "int8" is a ValueError (its
    kernels are the CPU's, one process's)."""
    from pagedkv.model.quant.apply import (
        PACKED_AUTO_DTYPES,
        check_quantization,
        pack_gguf_linears,
        pack_head,
        pack_prequantized_linears,
        quantize_int8,
    )

    fmt = prequantized(model_dir)
    check_quantization(quantization, fmt, model_dir)
    if quantization == "int8" and (device.type != "cpu" or tp is not None):
        where = f"device {device.type!r}" if device.type != "cpu" else "tensor parallelism"
        raise ValueError(f"quantization='int8' runs on a CPU without tensor parallelism, not "
                         f"with {where}: use quantization='auto' or 'none'")
    if fmt is not None and tp is not None:
        raise ValueError(f"{model_dir} is {method_named(fmt.method)} checkpoint, which pagedkv "
                         f"does not split for tensor parallelism: use tensor_parallel_size=1")
    # Before allocating for what config.json says.
    check_checkpoint_matches(model_dir, config.num_layers, config.vocab_size, config.hidden_size)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, tp) if tp is not None \
            else get_model_class(config.architecture)(config)
    model = model.to(dtype).to_empty(device=device)
    factors = _gguf_rope_factors(model_dir)
    for rotary in model.modules():  # buffers built on "meta": compute them (Gemma 3 has two)
        if isinstance(rotary, RotaryEmbedding):
            inv_freq = rope_inv_freq(rotary.head_dim, rotary.theta, rotary.scaling)
            if factors is not None:
                if factors.shape != inv_freq.shape:
                    raise ValueError(f"rope_freqs.weight of {model_dir} has {factors.numel()} "
                                     f"factors for {inv_freq.numel()} rotary frequencies")
                inv_freq = inv_freq / factors
            rotary.inv_freq = inv_freq.to(device)
    quantize = device.type == "cpu" and tp is None and (
        quantization == "int8" or (quantization != "none" and dtype in PACKED_AUTO_DTYPES))
    preloaded = frozenset()
    if quantize and fmt is None:
        preloaded = pack_gguf_linears(model, model_dir)
    elif quantize:
        with ExitStack() as stack:
            preloaded = pack_prequantized_linears(model, LazyState(model_dir, stack), fmt)
    load_weights(model, model_dir, preloaded)
    if quantize and quantization == "int8":
        quantize_int8(model)
        model.requantized = "int8"  # not the checkpoint's weights: the store's keys say so
    if quantize and (preloaded or quantization == "int8"):
        pack_head(model)
    return model.eval()
