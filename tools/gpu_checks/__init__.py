"""The checks of tools/gpu_check.sh, one file a check (correctness, k2layer, moe, model, determinism,
summary), sharing common.py; tools/gpu_check.py runs one of them: `python tools/gpu_check.py --step NAME`."""
