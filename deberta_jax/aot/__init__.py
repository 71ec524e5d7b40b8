"""Compiling for accelerators this machine does not have: `chips` (published per-chip figures; TPU slices from
libtpu's topologies, GPUs of one node from the CUDA plugin's), `build` (a run's programs lowered and compiled for
them), `analysis` (memory, cost, roofline and MFU of a compiled program). `python -m deberta_jax.aot` is the command.

May import every other subpackage but export; nothing imports it.
"""
