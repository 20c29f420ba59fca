"""Memory policies: what a block keeps for backward.

policies.py (recompute and offload per block and region; Runner, the fnmoe.models.seams.BlockRunner the
step is built with: train_runner), host_pool.py (the host memory offload copies into, sized where
the step is built: fnmoe.plan.activations.pool_bytes). What a policy measures against the plan and
whether its pool fits the host are fnmoe.plan's (memory_report.py, host_limit.py).
"""
