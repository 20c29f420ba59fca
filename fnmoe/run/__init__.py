"""What a training run leaves and hears: its directory, stops, metrics and plots.

rundir.py (the run directory and its lock), stop.py (signals and stop requests), metrics.py
(JSONL and TensorBoard writers, expert-load statistics), wandb_log.py (Weights & Biases),
plot.py (`fnmoe plot`), notes.py (what the log says of a run's length), faults.py (fault injection
for tests).
"""
