"""Weights kept quantized on the CPU, computed on packed (the `quantization` option).

`apply.pack_gguf_linears` (before the weights are read) swaps a GGUF model's linear layers for
packed ones: the 4- and 5-bit types with offsets (Q4_0, Q4_1, Q4_K, Q5_1, Q5_K) as
`int4_linear.Int4Linear` (exact: the file's own codes and scales), the int8-block ones (Q8_0,
Q6_K, Q5_0, Q3_K, IQ4; Q6_K, Q5_0, IQ4 and Q3_K codes in the file's 6, 5, 4 and 3 bits) as
`int8_block_linear.Int8BlockLinear`, a fused linear whose parts mix the two as
`parts_linear.PartsLinear` (one of each per run of parts), and the token embedding table and
LM head in either family (`vocab.pack_gguf_vocab`);
`apply.quantize_int8` (after, with `quantization="int8"`) any checkpoint's remaining linears as
`int8_linear.Int8Linear` (per-channel int8). A dense LM head gains a per-row int8 copy for
decode-sized calls (`packed_head.Int8PackedHead`).
The packed tensors are the modules' parameters, so the model's parameter bytes (the runner's
`weights_bytes`, which the KV cache planner subtracts) are the packed bytes.
"""
