"""Shared test setup: one inductor cache per test run, so only the first compile of a graph is cold."""
import os
import tempfile

# OpenMP's busy-waiting threads starve each other when test processes (torchrun ranks, CLI
# subprocesses) share 2 cores; passive waiting costs nothing when a core is free.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"fnmoe-test-inductor-{os.getuid()}"))


def rel(a, b) -> float:
    """max |a - b| relative to the largest |b|: the tests' one measure of closeness."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
