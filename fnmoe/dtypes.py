"""The dtype names configs use ("float32", "bfloat16", "float64"): one table of them as torch dtypes,
from which their bytes and short names follow.

Legend: no tensors here.
"""
from __future__ import annotations

import torch

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""a config's dtype name -> the torch dtype (model.compute_dtype, mesh.reduce_dtype, optim's dtypes)"""
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPE.items()}
"""a config's dtype name -> bytes an element (the planner's formulas)"""
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}
"""a config's dtype name -> how the planner's tables print it"""
