"""Checkpoints: atomic, checksummed snapshots of a run in the native tree format, and resume.

By concern: format.py (the on-disk format and its specification), procs.py (the processes that
save and load together), shards.py (what each rank writes), save.py (writing, commit, pruning,
`Saver`), load.py (verifying and reading), resume.py (resuming a run on any mesh).
"""
from fnmoe.checkpoint.format import FORMAT, SECTIONS, VERSION, CheckpointError, list_checkpoints, parts, read_index
from fnmoe.checkpoint.load import check_finite, load_params, saved_config, verify
from fnmoe.checkpoint.resume import check_resume_config, find_latest, load_state, resume_point
from fnmoe.checkpoint.save import Saver, index_only, prune, set_aside_after, write
from fnmoe.checkpoint.shards import Snapshot, snapshot

__all__ = ["FORMAT", "SECTIONS", "VERSION", "CheckpointError", "Saver", "Snapshot", "check_finite",
           "check_resume_config", "find_latest", "index_only",
           "list_checkpoints", "load_params", "load_state", "parts", "prune", "read_index",
           "resume_point", "saved_config", "set_aside_after", "snapshot", "verify", "write"]
