"""clear_caches(): empty every module-level cache fnmoe keeps.

Each is rebuilt on next use: a region compiles again, a policy wrapper, mesh lookup or epoch
permutation is computed again, a warning said once may be said again. Call it between runs
(tests, notebooks, a process that trains several models), not inside a step: a gathered weight
tracked for regathering would then be kept for backward instead.

Not caches, so kept: fnmoe.kernels.gemm's build-and-load (its ops and their fake kernels register once
per process) and the compile flags (set once per process). torch's own compile caches are torch's
(torch.compiler.reset).
"""
from __future__ import annotations

from fnmoe import compile as fcompile
from fnmoe.kernels import attention as cpu_attention
from fnmoe.data import loader as data
from fnmoe.memory import policies as memory
from fnmoe.parallel import reshard
from fnmoe.parallel import sharding
from fnmoe.parallel import gather as fgather


def clear_caches() -> None:
    fcompile.clear()                            # compiled regions, warnings said once
    reshard.clear()                             # gathered weights tracked for regathering (weakly held)
    fgather.clear()                             # collectives noted in flight (after a failed step)
    memory.with_policy.cache_clear()            # a region under a recompute policy
    cpu_attention._with_impl.cache_clear()      # configs with the attention impl resolved
    sharding._ranks.cache_clear()               # each mesh's ranks (keeps the meshes alive)
    sharding._submeshes.clear()                 # each mesh's sub-meshes (keeps the meshes alive)
    data._epoch_permutation.cache_clear()       # the last epochs' sample orders
