"""Tensor parallelism for the worker (Megatron-style): which shapes split (shapes.py), how the checkpoint is cut
and the model wired for it (sharding.py, parallel_layers.py), and the process group a group's ranks form once
they all attached to the scheduler (process_group.py)."""
