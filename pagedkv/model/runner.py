"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged KV cache and samples.

Per step, in order: swap out (device -> host), swap in (host -> device), block copies
(copy-on-write), then the forward pass over the scheduled tokens (decodes first, batched, then
prefill chunks), logits only at the last position of each request that samples (and at the
prompt positions whose logprobs were asked for, and at every position of a request verifying
speculative draft tokens, see logits_rows.py), and sampling (or verification, Sampler.verify).

Attention runs through the backend registered for the device (model/backends/): the runner
describes the step once (`StepSequences`) and the backend builds the metadata every layer reads.
On CUDA, unless `enforce_eager`, decode-only steps replay captured CUDA graphs (cuda_graphs.py).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedkv.config.dtypes import (
    canonical_dtype,
    is_fp8_dtype,
    is_int8_dtype,
    resolve_kv_cache_dtype,
)
from pagedkv.kernels.cpu import cpu_kernels_loaded, ensure_cpu_kernels
from pagedkv.kv.hf_spec import kv_cache_spec_from_hf_config
from pagedkv.kv.hybrid_spec import HybridKVCacheSpec
from pagedkv.kv.shard import shard_kv_cache_spec
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.model.backends import get_attention_backend
from pagedkv.model.backends.base import AttentionBackend
from pagedkv.model.backends.quantized import QuantizedKVBackend
from pagedkv.model.backends.step import StepSequences
from pagedkv.model.config import kv_cache_torch_dtype, parse_dtype
from pagedkv.model.cpu_memory import keep_freed_memory
from pagedkv.model.cpu_threads import CpuThreadGovernor
from pagedkv.model.kv_cache import KVCache
from pagedkv.model.kv_groups import LayerGroups
from pagedkv.model.load_log import weights_loaded, weights_loading
from pagedkv.model.loader import check_model_dir, load_model
from pagedkv.model.logits_rows import select_logits_rows
from pagedkv.model.parallel.group import TensorParallelGroup
from pagedkv.model.registry import CausalLM, model_config_from_dir
from pagedkv.model.runner_config import RunnerConfig
from pagedkv.model.sampler import Sampler, prompt_logprobs
from pagedkv.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagedkv.store.payload import pin_host_memory

if TYPE_CHECKING:
    from pagedkv.store.config import StoreConfig
    from pagedkv.store.connector import StoreConnectorWorker


def resolve_device(device: str | torch.device) -> torch.device:
    """CUDA when `device` is "auto" and CUDA is available, else CPU; otherwise `device` as given.
    ValueError for a CUDA device this machine does not have."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}") from e
    if resolved.type == "cuda" and not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else "finds no GPU"
        raise ValueError(f"device {device!r} (--device): CUDA is not available (torch "
                         f"{torch.__version__} {build}); use --device cpu or auto")
    return resolved


FP8_SCALE_MODES = ("per_head", "per_layer")


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the sampler of one engine."""

    def __init__(self, model_dir: str | Path, *, block_size: int, num_blocks: int | None,
                 num_host_blocks: int = 0, dtype: str = "auto", device: str = "auto",
                 seed: int = 0, kv_cache_spec: KVCacheSpec | None = None,
                 attention_backend: str | None = None,
                 cuda_graph_batch_sizes: list[int] | None = None,
                 max_model_len: int | None = None, cpu_kernels: str = "auto",
                 cpu_threads: int | None = None,
                 kv_cache_dtype: str = "auto", fp8_scales: str = "per_head",
                 tensor_parallel: TensorParallelGroup | None = None,
                 kv_store: StoreConfig | None = None, quantization: str = "auto") -> None:
        """`num_blocks` None: no KV cache yet (profile memory, then `allocate_kv_cache`).
        `kv_cache_spec` (the one the engine planned with) shapes the KV tensors; without it the
        spec is built from the same config reader, `block_size`, `dtype` and `kv_cache_dtype`
        ("auto": the model's dtype; an fp8 name: an fp8 cache, see kv_quant.py).
        `attention_backend`: a key of backends.ATTENTION_BACKENDS (default: the device's).
        `cuda_graph_batch_sizes`: capture decode graphs for these batch sizes once the KV cache
        exists (see `capture_cuda_graphs`; None or empty: eager), block tables up to
        `max_model_len` tokens (default: the model's max_position_embeddings).
        `cpu_kernels` (CPU only): when to use the fused C++ kernels (pagedkv.kernels.cpu);
        with "auto" the runner switches to them, between steps, once they are built.
        `cpu_threads` (CPU only): torch's thread count; None lets a CpuThreadGovernor follow
        the cores other processes leave free (cpu_threads.py).
        `fp8_scales` (fp8 caches): "per_head" (one calibrated scale per KV head and layer) or
        "per_layer" (one per layer, the earlier scheme; kv_calibration.py); a checkpoint's
        own `k_scale` / `v_scale` tensors, when it has them, are used instead.
        `tensor_parallel`: this runner is one rank of the group and holds its shard of the
        weights and its KV heads of every block (the spec counts this rank's KV heads); only
        rank 0 gets logits and samples (`execute` returns nothing elsewhere).
        `kv_store`: the KV store this rank builds (its KV heads, keys naming its rank) once
        its KV cache is allocated, behind the connector's worker side (`kv_connector`)."""
        if fp8_scales not in FP8_SCALE_MODES:
            raise ValueError(f"fp8_scales must be one of {FP8_SCALE_MODES}, got {fp8_scales!r}")
        self.fp8_scales = fp8_scales
        self.model_dir = model_dir
        check_model_dir(model_dir)  # a config.json claiming 10^9 layers fails before any build
        self.model_config = model_config_from_dir(model_dir)
        self.device = resolve_device(device)
        self.dtype = parse_dtype(dtype, self.model_config.torch_dtype)
        model_dtype = str(self.dtype).removeprefix("torch.")
        cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
        self.tensor_parallel = tensor_parallel
        spec = kv_cache_spec or shard_kv_cache_spec(kv_cache_spec_from_hf_config(
            self.model_config.hf_config, block_size, model_dtype, kv_cache_dtype),
            1 if tensor_parallel is None else tensor_parallel.size)
        if spec.block_size != block_size or \
                kv_cache_torch_dtype(spec.dtype) != kv_cache_torch_dtype(cache_dtype):
            raise ValueError(f"KV cache spec (block_size {spec.block_size}, {spec.dtype}) does "
                             f"not match block_size {block_size}, KV cache dtype {cache_dtype}")
        self.kv_cache_spec = spec
        self.block_size = block_size
        # Hybrid KV cache groups (a model mixing attention types): layer -> (group, slot).
        self.layer_groups = LayerGroups(spec) if isinstance(spec, HybridKVCacheSpec) else None
        allocated = self._allocated_bytes()
        started = weights_loading(model_dir, tensor_parallel)
        self.model: CausalLM = load_model(model_dir, self.model_config, self.dtype,
                                          self.device, tensor_parallel, quantization)
        self.weights_bytes = self._allocated_bytes() - allocated if self.device.type == "cuda" \
            else sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights_loaded(started, self.weights_bytes, self.dtype, self.device, tensor_parallel)
        self.kv_cache: KVCache | None = None
        self.sampler = Sampler(seed, self.device)
        # The device's backend, and the one layers attend through (the device's, or it
        # wrapped by QuantizedKVBackend for a cache it does not read).
        self.device_attn_backend = get_attention_backend(self.device, attention_backend)
        self.attn_backend: AttentionBackend = self.device_attn_backend
        self.cpu_kernels = "off" if self.device.type != "cpu" else cpu_kernels
        ensure_cpu_kernels(self.cpu_kernels)  # "auto": a cached build, or a background one
        if not self._use_cpu_kernels():  # (which packs for panel_linear when loaded)
            self.model.pack_linear_weights()  # the torch path's: oneDNN, or a float32 copy
        self.thread_governor = None
        if self.device.type == "cpu":
            keep_freed_memory()
            if cpu_threads is None:
                self.thread_governor = CpuThreadGovernor()
            else:
                torch.set_num_threads(cpu_threads)
        self.kv_scales = None  # fp8 cache: each layer's KVScales, computed at allocation
        if self._needs_quantized_wrapper(spec.dtype, model_dtype):
            self.attn_backend = QuantizedKVBackend(
                self.attn_backend, reads_in_place=is_fp8_dtype(spec.dtype) or is_int8_dtype(spec.dtype))
        self.cuda_graphs = None
        self.kv_store_config = kv_store
        self.kv_connector: StoreConnectorWorker | None = None  # built with the KV cache
        if num_blocks is not None:
            self.allocate_kv_cache(num_blocks, num_host_blocks)
            if cuda_graph_batch_sizes:
                self.capture_cuda_graphs(cuda_graph_batch_sizes, max_model_len)

    @classmethod
    def from_config(cls, config: RunnerConfig,
                    tensor_parallel: TensorParallelGroup | None = None) -> ModelRunner:
        """The runner `config` describes, without a KV cache yet (`allocate_kv_cache`)."""
        return cls(config.model, **config.runner_kwargs(), tensor_parallel=tensor_parallel)

    def _needs_quantized_wrapper(self, cache_dtype: str, model_dtype: str) -> bool:
        """Whether the backend attends over a `cache_dtype` cache only through
        QuantizedKVBackend: an fp8 or int8 cache unless the backend `reads_cache_dtypes` it,
        and a cache of another model dtype than the model's always; never for a model whose
        attention stores and reads the cache itself (`attention_reads_kv_cache`: Gemma 2's
        soft-capped attention)."""
        if getattr(self.model, "attention_reads_kv_cache", False):
            return False
        if is_fp8_dtype(cache_dtype) or is_int8_dtype(cache_dtype):
            return cache_dtype not in self.attn_backend.reads_cache_dtypes
        return cache_dtype != canonical_dtype(model_dtype)

    def _use_cpu_kernels(self) -> bool:
        """Point the model's elementwise ops and the attention backend at the fused CPU kernels
        when they are loaded and allowed (cheap; called before every step). Returns whether."""
        fused = self.cpu_kernels != "off" and cpu_kernels_loaded()
        if fused and not self.model.ops.cpu_fused:
            self.model.pack_linear_weights(panels=True)  # panel_linear from now on
        self.model.ops.cpu_fused = fused
        self.attn_backend.set_fused(fused)
        return fused

    def _allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def allocate_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Allocate the device KV cache (and the host swap copy) of `num_blocks` blocks, shaped
        by `kv_cache_spec` (planned bytes == allocated bytes). An fp8 cache's scales are
        the checkpoint's when it carries them (kv_checkpoint_scales.py), else computed first,
        once (kv_calibration.py); either way set on the model's attention layers."""
        if is_fp8_dtype(self.kv_cache_spec.dtype) and self.kv_scales is None:
            self.kv_scales = self._checkpoint_kv_scales()
            if self.kv_scales is None:
                self._calibrate_kv_scales()
            for layer, scales in zip(self.model.layers, self.kv_scales, strict=True):
                layer.self_attn.kv_scales = scales
        self.kv_cache = KVCache.from_spec(self.kv_cache_spec, num_blocks=num_blocks,
                                          device=self.device, num_host_blocks=num_host_blocks)
        self.kv_cache.scales = self.kv_scales
        per_token = self.kv_cache.layer_scales()  # int8: each slot's views of its scales
        if per_token is not None:
            if self.layer_groups is not None:  # a model layer's slot in its group's blocks
                per_token = self.layer_groups.layer_caches(per_token)
            for layer, scales in zip(self.model.layers, per_token, strict=True):
                layer.self_attn.kv_scales = scales
        # Each model layer's (K, V) views: its group's slot of the blocks with KV cache groups.
        self.layer_kv_caches = self.kv_cache.layers if self.layer_groups is None \
            else self.layer_groups.layer_caches(self.kv_cache.layers)
        if self.kv_store_config is not None and self.kv_connector is None:
            self.kv_connector = self._build_kv_store()

    def _calibrate_kv_scales(self) -> None:
        from pagedkv.model.kv_calibration import calibrate_kv_scales

        self.kv_scales = calibrate_kv_scales(
            self.model, self.device_attn_backend, self.kv_cache_spec,
            str(self.dtype).removeprefix("torch."), kv_cache_torch_dtype(self.kv_cache_spec.dtype),
            self.model_config.vocab_size, self.model_config.max_position_embeddings, self.device,
            per_head=self.fp8_scales == "per_head")

    def _checkpoint_kv_scales(self) -> list | None:
        """The checkpoint's own fp8 KV scales (kv_checkpoint_scales.py), this rank's KV heads of
        them with tensor parallelism; None when it has none."""
        from pagedkv.model.kv_checkpoint_scales import read_checkpoint_kv_scales

        cfg, heads = self.model_config, None
        if self.tensor_parallel is not None:
            local = self.kv_cache_spec.num_kv_heads
            start = self.tensor_parallel.rank * cfg.num_kv_heads // self.tensor_parallel.size
            heads = slice(start, start + local) if local * self.tensor_parallel.size \
                == cfg.num_kv_heads else slice(0, 0)
        return read_checkpoint_kv_scales(self.model_dir, cfg.num_layers, cfg.num_kv_heads, heads)

    def capture_cuda_graphs(self, batch_sizes: list[int], max_model_len: int | None = None) -> bool:
        """Capture decode CUDA graphs for `batch_sizes` over the allocated KV cache (CUDA and a
        backend that `supports_cuda_graphs` only, reading a quantized cache in place if any;
        returns whether graphs were captured)."""
        if not batch_sizes or self.device.type != "cuda" \
                or not self.attn_backend.supports_cuda_graphs \
                or self.tensor_parallel is not None or self.layer_groups is not None:
            return False
        from pagedkv.model.cuda_graphs import DecodeCudaGraphs

        max_len = max_model_len or self.model_config.max_position_embeddings
        self.cuda_graphs = DecodeCudaGraphs(self.model, self.kv_cache.layers, batch_sizes,
                                            -(-max_len // self.block_size), self.device)
        self.cuda_graphs.capture()
        return True

    @torch.inference_mode()
    def profile_activation_peak(self, num_tokens: int, max_num_seqs: int,
                                max_model_len: int) -> int:
        """Peak device bytes (above weights) of a forward pass over `num_tokens` prompt tokens
        (sequences of at most `max_model_len`) plus logits and sampling of `max_num_seqs` rows,
        as vLLM's profile run measures it; CUDA only. Uses and frees a scratch KV cache of just
        the blocks those tokens need (counted out of the peak)."""
        if self.device.type != "cuda":
            raise ValueError("memory profiling needs a CUDA device")
        bs, cfg = self.block_size, self.model_config
        lens = [min(max_model_len, num_tokens - s) for s in range(0, num_tokens, max_model_len)]
        scratch_blocks = sum(-(-n // bs) for n in lens) + 1
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = self._allocated_bytes()
        scratch = KVCache.from_spec(self.kv_cache_spec, num_blocks=scratch_blocks,
                                    device=self.device)
        scratch_bytes = self._allocated_bytes() - base
        tables, next_block = [], 1
        for n in lens:
            tables.append(list(range(next_block, next_block + -(-n // bs))))
            next_block += len(tables[-1])
        slots = [t[p // bs] * bs + p % bs for t, n in zip(tables, lens, strict=True)
                 for p in range(n)]
        step = StepSequences(num_new_tokens=lens, seq_lens=lens, block_tables=tables,
                             slot_mapping=slots, num_decodes=0, block_size=bs)
        ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=self.device)
        pos = torch.tensor([p for n in lens for p in range(n)], device=self.device)
        layers = scratch.layers if self.layer_groups is None \
            else self.layer_groups.layer_caches(scratch.layers)  # every group: the same tables
        hidden = self.model(ids, pos, layers, self.attn_backend.build_metadata(step))
        rows = hidden[: max(1, min(max_num_seqs, num_tokens))]
        logits = self.model.compute_logits(rows)
        if logits is not None:  # None on tensor-parallel ranks other than 0
            logits.argmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - scratch_bytes
        del scratch, hidden, rows
        gc.collect()
        torch.cuda.empty_cache()
        return max(peak, 0)

    # ---- the KV store (store/connector.py): this rank's worker side --------------------------

    def _build_kv_store(self) -> StoreConnectorWorker:
        """This rank's KV store over the allocated cache, behind the connector's worker side.
        Its keys say what the bytes mean (`store_dtype_tag`) and which rank's heads they hold."""
        from pagedkv.store.factory import build_worker

        return build_worker(self.kv_store_config, self.kv_cache_spec, KVCache.LAYOUT,
                            self.store_dtype_tag(),
                            pin_memory=pin_host_memory(self.kv_cache.device),
                            group=self.tensor_parallel)

    def store_dtype_tag(self) -> str:
        """What this runner's KV bytes mean, for the store's keys: the cache's `dtype_tag()`
        (its dtype, int8's scale layout, fp8's scales) and the weights' dtype, which computed
        them: an int8 (or fp8, or bfloat16) block of float32 weights is not what bfloat16
        weights would write, so the two never share blocks, as two "auto" caches of those
        dtypes never do; nor does a block of weights requantized to int8 (`quantization`)."""
        tag = f"{self.kv_cache.dtype_tag()};weights={self.dtype}"
        requantized = getattr(self.model, "requantized", None)
        return tag if requantized is None else f"{tag};requantized={requantized}"

    def flush_kv_store(self) -> None:
        """Wait until this rank's queued store saves are written (tests, benchmarks)."""
        if self.kv_connector is not None:
            self.kv_connector.store.flush()

    def kv_store_stats(self) -> list[dict]:
        """This rank's store tiers' counters (`TierStats.to_dict`), fastest tier first."""
        if self.kv_connector is None:
            return []
        return [t.to_dict() for t in self.kv_connector.store.snapshot_stats()]

    def collective_seconds(self) -> dict[str, float]:
        """Seconds this rank spent in each kind of collective so far, waiting for the other
        ranks included ({} without tensor parallelism)."""
        return {} if self.tensor_parallel is None else dict(self.tensor_parallel.seconds)

    def shutdown(self) -> None:
        """Drop the CUDA graphs, the KV cache and the weights, and hand freed device memory back
        to the driver, so another engine in this process can size itself from it; close this
        rank's KV store (its queued saves written first). The runner is unusable afterwards."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        self.cuda_graphs = None
        self.kv_cache = None
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's block moves, run the forward pass and sample (mutates the KV cache
        and the per-request generators)."""
        try:
            return self._execute(out)
        finally:
            if self.thread_governor is not None:
                self.thread_governor.step_done()

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_request_ids:
            self.sampler.forget(rid)
        self.kv_cache.swap_out(out.blocks_to_swap_out)
        self.kv_cache.swap_in(out.blocks_to_swap_in)
        self.kv_cache.copy(out.blocks_to_copy)
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(out.kv_connector_metadata, self.kv_cache)
        result = ModelRunnerOutput()
        if not out.scheduled:
            return result
        if self.cpu_kernels == "auto" and not self.model.ops.cpu_fused:
            self._use_cpu_kernels()  # until the background build is loaded
        if self.thread_governor is not None:
            self.thread_governor.adjust()
        reqs, ids, pos, step = self.describe_step(out.scheduled)
        graphs = self.cuda_graphs
        if graphs is not None and step.num_decodes == len(reqs) \
                and graphs.padded_size(len(reqs)) is not None:
            hidden = graphs.replay(ids, pos, step.slot_mapping, step.block_tables)
        else:
            dev = self.device
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                                torch.tensor(pos, dtype=torch.long, device=dev),
                                self.layer_kv_caches, self.build_metadata(reqs, step))
        if self.kv_connector is not None:
            self.kv_connector.save_kv(out.kv_connector_metadata, self.kv_cache)
        selection = select_logits_rows(reqs)
        if selection.empty:
            return result
        logits = self.model.compute_logits(selection.gather(hidden))
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return result
        for rows in selection.prompt_rows:
            req = rows.request
            result.prompt_logprobs[req.request_id] = prompt_logprobs(
                logits[rows.first_row:rows.first_row + rows.count], rows.target_ids,
                req.sampling_params.prompt_logprobs or 0)
        if selection.verifiers:
            self._verify(selection.verify_logits(logits), selection.verifiers, result)
        if not selection.samplers:
            return result
        tokens, logprobs = self.sampler(selection.sample_logits(logits), selection.samplers)
        for req, toks, lps in zip(selection.samplers, tokens, logprobs, strict=True):
            result.sampled_token_ids[req.request_id] = toks
            if lps is not None:
                result.logprobs[req.request_id] = lps
        return result

    def _verify(self, logits: torch.Tensor, reqs: list[ScheduledRequest],
                result: ModelRunnerOutput) -> None:
        """Verify the draft tokens of `reqs` (their k + 1 logits rows each, in turn): each
        request's emitted run (and its logprobs) into `result`."""
        tokens, logprobs = self.sampler.verify(logits, reqs)
        for req, toks, lps in zip(reqs, tokens, logprobs, strict=True):
            result.sampled_token_ids[req.request_id] = toks
            if lps is not None:
                result.logprobs[req.request_id] = lps

    def prepare_inputs(self, scheduled: list[ScheduledRequest]
                       ) -> tuple[list[ScheduledRequest], torch.Tensor, torch.Tensor, object]:
        """(requests in batch order, input ids [T], positions [T], the attention backend's
        metadata) for an eager forward pass; see `describe_step`."""
        reqs, ids, pos, step = self.describe_step(scheduled)
        dev = self.device
        return (reqs, torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev),
                self.build_metadata(reqs, step))

    def build_metadata(self, reqs: list[ScheduledRequest], step: StepSequences) -> object:
        """The backend's attention metadata for the step: one object, or with KV cache groups
        a list with each model layer's (its group's tables and slots)."""
        if self.layer_groups is None:
            return self.attn_backend.build_metadata(step)
        groups = self.layer_groups
        return groups.layer_metadata([self.attn_backend.build_metadata(s)
                                      for s in groups.group_steps(reqs, step)])

    def describe_step(self, scheduled: list[ScheduledRequest]
                      ) -> tuple[list[ScheduledRequest], list[int], list[int], StepSequences]:
        """Order the requests (decodes first) and flatten their tokens: (requests in batch
        order, token ids, positions, the step's sequences). Raises ValueError for a request
        whose block table cannot hold its tokens."""
        bs = self.block_size
        for r in scheduled:
            n = len(r.token_ids)
            if len(r.block_table) * bs < r.start_pos + n or n == 0:
                _check_scheduled(r, bs)
        decodes = [r for r in scheduled if len(r.token_ids) == 1]
        prefills = [r for r in scheduled if len(r.token_ids) > 1]
        reqs = decodes + prefills
        ids: list[int] = [r.token_ids[0] for r in decodes]
        pos: list[int] = [r.start_pos for r in decodes]
        slots: list[int] = [r.block_table[r.start_pos // bs] * bs + r.start_pos % bs
                            for r in decodes]
        for r in prefills:
            ids.extend(r.token_ids)
            seq_len = r.start_pos + r.num_new_tokens
            pos.extend(range(r.start_pos, seq_len))
            for b in range(r.start_pos // bs, (seq_len + bs - 1) // bs):  # one range per block
                base = r.block_table[b] * bs
                slots.extend(range(base + max(r.start_pos - b * bs, 0),
                                   base + min(seq_len - b * bs, bs)))
        num_new = [1] * len(decodes) + [len(r.token_ids) for r in prefills]
        step = StepSequences(
            num_new_tokens=num_new,
            seq_lens=[r.start_pos + n for r, n in zip(reqs, num_new, strict=True)],
            block_tables=[r.block_table for r in reqs], slot_mapping=slots,
            num_decodes=len(decodes), block_size=bs)
        return reqs, ids, pos, step


def _check_scheduled(r: ScheduledRequest, block_size: int) -> None:
    """Raise ValueError for a request scheduled with no tokens, or whose block table cannot
    hold its tokens."""
    if r.num_new_tokens == 0:
        raise ValueError(f"request {r.request_id!r} is scheduled with no tokens")
    needed = (r.start_pos + r.num_new_tokens + block_size - 1) // block_size
    if len(r.block_table) < needed:
        raise ValueError(f"request {r.request_id!r}: block table has {len(r.block_table)} "
                         f"blocks, {needed} needed for {r.start_pos + r.num_new_tokens} tokens")
