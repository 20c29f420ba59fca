"""Planning a run before it runs: bytes, FLOPs, communication and step time from shapes alone.

summary.py (the plan of one run), network.py (which groups span nodes; the EP exchange's
traffic), search.py (every layout of a world size, ranked), meters.py (storage and collectives
measured at the ops), rehearse.py (a step run on fake tensors, measured against the plan), inspect_compile.py
(`fnmoe inspect`: what torch.compile makes of each region of the model).
"""
