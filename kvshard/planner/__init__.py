"""DCP capacity and throughput planner: what each TP/DCP layout gives for a real model
on a real GPU cluster, from datasheet figures and the model's config.json. Pure Python:
no torch, no GPU, no engine run. Entry points: `kvshard plan` and `python -m kvshard.planner`.
"""
