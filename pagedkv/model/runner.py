"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged KV cache and samples.

Per step, in order: swap out (device -> host), swap in (host -> device), block copies
(copy-on-write), then the forward pass over the scheduled tokens (decodes first, batched, then
prefill chunks), logits only at the last position of each request that samples (and at the
prompt positions whose logprobs were asked for, see logits_rows.py), and sampling.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedkv.kv.spec import KVCacheSpec, kv_cache_spec_from_hf_config
from pagedkv.model.attention import AttentionMetadata, PrefillChunk
from pagedkv.model.config import ModelConfig, parse_dtype, torch_dtype
from pagedkv.model.kv_cache import KVCache
from pagedkv.model.loader import check_model_dir, load_model
from pagedkv.model.logits_rows import select_logits_rows
from pagedkv.model.registry import CausalLM
from pagedkv.model.sampler import Sampler, prompt_logprobs
from pagedkv.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


def resolve_device(device: str | torch.device) -> torch.device:
    """CUDA when `device` is "auto" and CUDA is available, else CPU; otherwise `device` as given."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"invalid device {device!r}") from e


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the sampler of one engine."""

    def __init__(self, model_dir: str | Path, *, block_size: int, num_blocks: int,
                 num_host_blocks: int = 0, dtype: str = "auto", device: str = "auto",
                 seed: int = 0, kv_cache_spec: KVCacheSpec | None = None) -> None:
        """`kv_cache_spec` (the one the engine planned with) shapes the KV tensors; without it
        the spec is built from the same config reader, `block_size` and `dtype`."""
        check_model_dir(model_dir)  # a config.json claiming 10^9 layers fails before any build
        self.model_config = ModelConfig.from_dir(model_dir)
        self.device = resolve_device(device)
        self.dtype = parse_dtype(dtype, self.model_config.torch_dtype)
        spec = kv_cache_spec or kv_cache_spec_from_hf_config(
            self.model_config.hf_config, block_size, str(self.dtype).removeprefix("torch."))
        if spec.block_size != block_size or torch_dtype(spec.dtype) != self.dtype:
            raise ValueError(f"KV cache spec (block_size {spec.block_size}, {spec.dtype}) does "
                             f"not match block_size {block_size}, dtype {self.dtype}")
        self.kv_cache_spec = spec
        self.block_size = block_size
        self.model: CausalLM = load_model(model_dir, self.model_config, self.dtype,
                                                  self.device)
        self.kv_cache = KVCache.from_spec(spec, num_blocks=num_blocks, device=self.device,
                                          num_host_blocks=num_host_blocks)
        self.sampler = Sampler(seed, self.device)
        self._attn_workspace: dict = {}  # attention scratch buffers, reused across steps
        self.kv_connector = None  # the KV store's worker side, plugged in by the engine

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's block moves, run the forward pass and sample (mutates the KV cache
        and the per-request generators)."""
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
        reqs, input_ids, positions, meta = self.prepare_inputs(out.scheduled)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        if self.kv_connector is not None:
            self.kv_connector.save_kv(out.kv_connector_metadata, self.kv_cache)
        selection = select_logits_rows(reqs)
        if selection.empty:
            return result
        logits = self.model.compute_logits(selection.gather(hidden))
        for rows in selection.prompt_rows:
            req = rows.request
            result.prompt_logprobs[req.request_id] = prompt_logprobs(
                logits[rows.first_row:rows.first_row + rows.count], rows.target_ids,
                req.sampling_params.prompt_logprobs or 0)
        if not selection.samplers:
            return result
        tokens, logprobs = self.sampler(selection.sample_logits(logits), selection.samplers)
        for req, toks, lps in zip(selection.samplers, tokens, logprobs, strict=True):
            result.sampled_token_ids[req.request_id] = toks
            if lps is not None:
                result.logprobs[req.request_id] = lps
        return result

    def prepare_inputs(self, scheduled: list[ScheduledRequest]
                       ) -> tuple[list[ScheduledRequest], torch.Tensor, torch.Tensor,
                                  AttentionMetadata]:
        """Order the requests (decodes first), flatten their tokens and build the attention
        metadata. Raises ValueError for a request whose block table cannot hold its tokens."""
        bs = self.block_size
        for r in scheduled:
            if r.num_new_tokens == 0:
                raise ValueError(f"request {r.request_id!r} is scheduled with no tokens")
            needed = (r.start_pos + r.num_new_tokens + bs - 1) // bs
            if len(r.block_table) < needed:
                raise ValueError(f"request {r.request_id!r}: block table has {len(r.block_table)} "
                                 f"blocks, {needed} needed for {r.start_pos + r.num_new_tokens} tokens")
        decodes = [r for r in scheduled if r.num_new_tokens == 1]
        prefills = [r for r in scheduled if r.num_new_tokens > 1]
        reqs = decodes + prefills
        ids: list[int] = [r.token_ids[0] for r in decodes]
        pos: list[int] = [r.start_pos for r in decodes]
        slots: list[int] = [r.block_table[r.start_pos // bs] * bs + r.start_pos % bs
                            for r in decodes]
        dec_lens = [p + 1 for p in pos]
        max_blocks = max((len(r.block_table) for r in decodes), default=0)
        dec_tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r in decodes]
        dev = self.device
        chunks, start = [], len(decodes)
        for r in prefills:
            ids.extend(r.token_ids)
            seq_len = r.start_pos + r.num_new_tokens
            pos.extend(range(r.start_pos, seq_len))
            for b in range(r.start_pos // bs, (seq_len + bs - 1) // bs):  # one range per block
                base = r.block_table[b] * bs
                slots.extend(range(base + max(r.start_pos - b * bs, 0),
                                   base + min(seq_len - b * bs, bs)))
            table = torch.tensor(r.block_table[: (seq_len + bs - 1) // bs], dtype=torch.long)
            chunks.append(PrefillChunk(start, start + r.num_new_tokens, r.start_pos, seq_len,
                                       table.to(dev)))
            start += r.num_new_tokens
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decodes),
            decode_seq_lens=torch.tensor(dec_lens, dtype=torch.long, device=dev),
            decode_block_tables=torch.tensor(dec_tables, dtype=torch.long,
                                             device=dev).view(len(decodes), max_blocks),
            prefills=chunks,
            block_size=bs,
            decode_seq_lens_list=dec_lens,
            workspace_buffers=self._attn_workspace,
        )
        return (reqs, torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta)
