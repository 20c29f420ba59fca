"""Shared test setup: one inductor cache per test run, so only the first compile of a graph is cold."""
import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"fnmoe-test-inductor-{os.getuid()}"))
