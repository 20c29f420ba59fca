"""One config for every rank: at start each rank's resolved config is compared with rank 0's, so a
job whose ranks were given different flags or files stops before step 1 with one line naming the
first field that differs.

Without it a different lr on one rank trains silently (the ranks' replicas drift apart), different
step counts leave one rank waiting in a collective the others never enter, and a different shape
aborts inside gloo. The ranks all-gather a sha256 of their flattened config (a few bytes each);
only when the hashes differ do they gather the flattened configs themselves, and every rank raises
the same `ConfigMismatch`, before the mesh is made (a mesh of other sizes would itself hang).

PER_RANK lists the fields that may differ by rank: they change no value a rank computes.

Legend: no tensors here.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist

from fnmoe.config import RunConfig, to_dict
from fnmoe.parallel import dist as fdist

PER_RANK = ("compile_cache", "train.threads")
"""fields a rank may set for itself: a host's compile cache directory, a host's CPU thread count"""

_UNSET = "<not a field of this rank's fnmoe>"


class ConfigMismatch(ValueError):
    """The ranks of one job were given different configs. A ValueError: the CLI prints one line."""


def flat_config(run: RunConfig) -> dict[str, Any]:
    """run as {dotted field: value} in the config's field order, without PER_RANK."""
    out: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif prefix + key not in PER_RANK:
                out[prefix + key] = value
    walk(to_dict(run), "")
    return out


def digest(flat: dict[str, Any]) -> str:
    """sha256 of a flat config: equal digests, equal configs."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=repr).encode()).hexdigest()


def mismatch(flats: list[dict[str, Any]]) -> str | None:
    """None when every rank's flat config (in rank order) is rank 0's; else one line naming the first
    rank that differs, the first field and both values, and how many fields and ranks differ."""
    first, ranks = None, []
    for r, flat in enumerate(flats[1:], 1):
        keys = list(flats[0]) + [k for k in flat if k not in flats[0]]
        fields = [k for k in keys if flats[0].get(k, _UNSET) != flat.get(k, _UNSET)]
        if fields:
            ranks.append(r)
            first = first or (r, fields)
    if first is None:
        return None
    r, fields = first
    name = fields[0]
    shown = lambda v: v if v == _UNSET else json.dumps(v, default=repr)  # noqa: E731
    more = f"; {len(fields)} fields differ: {', '.join(fields[:6])}{', ...' if len(fields) > 6 else ''}" \
        if len(fields) > 1 else ""
    others = f" (ranks {', '.join(map(str, ranks[:8]))}{', ...' if len(ranks) > 8 else ''} of {len(flats)} differ " \
        "from rank 0)" if len(ranks) > 1 else ""
    return (f"the ranks were given different configs: {name} is {shown(flats[0].get(name, _UNSET))} on rank 0 and "
            f"{shown(flats[r].get(name, _UNSET))} on rank {r}{more}{others}; every rank must run the same config "
            "(the same --config file and flags); stopped before step 1")


def check_same_config(run: RunConfig) -> None:
    """Raise ConfigMismatch on every rank when any rank's config differs from rank 0's (PER_RANK
    aside). Collective over the default group: every rank calls it once the group is up (in a
    simulation the one process's config stands for every rank's). One process returns at once."""
    if not dist.is_initialized() or fdist.world() == 1:
        return
    flat = flat_config(run)
    fdist.entering("all-gather of the config's hash over every rank")
    hashes: list[Any] = [None] * fdist.world()
    dist.all_gather_object(hashes, digest(flat))
    if len(set(hashes)) == 1:
        return
    fdist.entering("all-gather of the configs over every rank")
    flats: list[Any] = [None] * fdist.world()
    dist.all_gather_object(flats, flat)
    error = mismatch(flats)
    if error:
        raise ConfigMismatch(error)
