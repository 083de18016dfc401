"""Native kernels: pagedkv's fused CPU operators (csrc/: a file per op family, the headers they
share, bindings.cpp), built on first use (cpu.py)."""
