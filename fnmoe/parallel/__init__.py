"""Parallelism on the 2-D ("fsdp", "ep") mesh, applied beside the model, not inside it.

dist.py (process groups, the mesh, where tensors live), sharding.py (logical-axis rules, param
specs, sharding a tree, init_params on a mesh), gather.py (FSDP: a block's params gathered,
prefetched, gradients reduce-scattered), fsdp.py (FSDP as the model's params source; the exchange a
MoE layer's params carry), fp8.py (the expert stacks' gathers in float8: block quantisation, what a
rank sends, the stack dequantised), reshard.py (gathered weights dropped after forward and gathered
again in backward), dispatch.py (the expert-parallel token exchange, the model's Exchange, and the
collectives it uses).
"""
