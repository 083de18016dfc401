"""The real model (SmolLM2-135M-Instruct, Q4_1) with its linears kept packed against the same
file dequantized, both bfloat16: along each prompt's greedy continuation (the dequantized
model's), the packed model's next-token distributions (KL, top-1 agreement) at every decode
step (one row: the int4 product on int8 activations, the head on the file's Q8_0 embedding
codes) and over the whole text prefilled (the dense head; the linears on the int4 product
where AVX-512 VNNI's panel product or AMX-INT8 tiles run, else on the expanded weight)."""

from __future__ import annotations

import torch

from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.int8_block_linear import Int8BlockEmbedding, Int8BlockLinear
from pagedkv.model.runner import ModelRunner
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.testing.kv_quant_accuracy import kl_divergence, prompt_logits, teacher_forced_logits
from tests.model.driver import greedy_generate

PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The three primary colors are"]
NEW_TOKENS = 8
# Measured: mean KL about 5e-3 nats, top-1 0.97 (activations quantized to int8 per group of 32
# at decode and, where AVX-512 VNNI's panel product or AMX tiles run, in the prefills too, as
# llama.cpp's Q4 x Q8 dot, against the dequantized bfloat16 model); an offset term that meets
# the activations' float sums rather than their quantized ones measured 2.2e-2, and a broken
# packed kernel gives tenths of a nat and more.
MEAN_KL_BOUND = 0.01
TOP1_BOUND = 0.9


def _runner(path, quantization: str) -> ModelRunner:
    return ModelRunner(str(path), block_size=16, num_blocks=8, device="cpu", dtype="bfloat16",
                       quantization=quantization, cpu_threads=1)


@torch.inference_mode()
def test_packed_smollm2_matches_dequantized(real_model_path):
    dense, packed = _runner(real_model_path, "none"), _runner(real_model_path, "auto")
    assert sum(isinstance(m, Int4Linear) for m in packed.model.modules()) == 30 * 4
    tokenizer = Tokenizer.from_dir(real_model_path)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    continuations = greedy_generate(dense, prompts, NEW_TOKENS)  # all three, one step a token
    refs, got, texts = [], [], []
    for text, prompt, continuation in zip(PROMPTS, prompts, continuations, strict=True):
        texts.append(text + tokenizer.decode(continuation))
        refs += [teacher_forced_logits(dense, prompt, continuation),
                 prompt_logits(dense, prompt + continuation)]
        got += [teacher_forced_logits(packed, prompt, continuation),
                prompt_logits(packed, prompt + continuation)]
    kl = kl_divergence(refs, got)
    print(f"\nSmolLM2 Q4_1 packed vs dequantized (bfloat16): mean KL {kl.mean_kl:.2e} nats, "
          f"p99 {kl.p99_kl:.2e}, top-1 agreement {kl.top1_agreement:.3f} over {kl.positions} "
          f"positions; {texts}")
    assert kl.mean_kl < MEAN_KL_BOUND, kl
    assert kl.top1_agreement >= TOP1_BOUND, kl
    head, table = packed.model.lm_head, packed.model.embed_tokens
    # The file's Q8_0 embedding table kept packed; the tied head computes on its very codes.
    assert isinstance(table, Int8BlockEmbedding) and isinstance(head, Int8BlockLinear)
    assert head.codes is table.codes and head.block == 32
    assert packed.weights_bytes < 0.6 * dense.weights_bytes
