"""The real model (SmolLM2-135M-Instruct, Q4_1) with its linears kept packed against the same
file dequantized, both bfloat16: along each prompt's greedy continuation (the dequantized
model's), the packed model's next-token distributions (KL, top-1 agreement) at every decode
step (one row: torch's int4 kernel, the LM head's int8 copy) and over the whole text prefilled
(the expanded weight, the dense head)."""

from __future__ import annotations

import torch

from pagedkv.model.quant.int4_linear import Int4Linear
from pagedkv.model.quant.packed_head import Int8PackedHead
from pagedkv.model.runner import ModelRunner
from pagedkv.model.tokenizer import Tokenizer
from pagedkv.testing.kv_quant_accuracy import kl_divergence, prompt_logits, teacher_forced_logits

PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The three primary colors are"]
NEW_TOKENS = 8
# Measured: mean KL about 2.2e-3 nats, top-1 0.97 (bfloat16 scales and activations against the
# dequantized bfloat16 model); a broken packed kernel gives tenths of a nat and more.
MEAN_KL_BOUND = 0.02
TOP1_BOUND = 0.9


def _runner(path, quantization: str) -> ModelRunner:
    return ModelRunner(str(path), block_size=16, num_blocks=8, device="cpu", dtype="bfloat16",
                       quantization=quantization, cpu_threads=1)


def _greedy(runner: ModelRunner, prompt: list[int]) -> list[int]:
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        out.append(int(teacher_forced_logits(runner, prompt, out)[-1].argmax()))
    return out


@torch.inference_mode()
def test_packed_smollm2_matches_dequantized(real_model_path):
    dense, packed = _runner(real_model_path, "none"), _runner(real_model_path, "auto")
    assert sum(isinstance(m, Int4Linear) for m in packed.model.modules()) == 30 * 4
    tokenizer = Tokenizer.from_dir(real_model_path)
    refs, got, texts = [], [], []
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        continuation = _greedy(dense, prompt)
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
    head = packed.model.lm_head
    assert isinstance(head, Int8PackedHead)  # tied: an int8 copy beside the bfloat16 embeddings
    head_bytes = head.codes.numel() + 2 * head.scale.numel()
    assert head_bytes == head.out_features * (head.in_features + 2)
    assert packed.weights_bytes - head_bytes < 0.7 * dense.weights_bytes
