"""Memory policies: what a block keeps for backward.

policies.py (recompute and offload per block and region, the training runner), runner.py (the
seam between the model and a policy), host_pool.py (the host memory offload copies into on a
CPU-only machine), report.py (a policy's measured memory against the plan).
"""
