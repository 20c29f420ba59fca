"""CPU kernels: a C++ extension (csrc/) built on first use, as torch ops.

gemm.py (the experts' grouped GEMMs, and the build and load of the extension), attention.py
(causal attention for short rows in bfloat16).
"""
