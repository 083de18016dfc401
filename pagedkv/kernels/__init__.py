"""Native kernels: pagedkv's fused CPU operators (cpu_ops.cpp), built on first use (cpu.py)."""
