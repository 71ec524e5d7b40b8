"""Experiment configs: `get_config(size)` files read by `train.py --config configs/<family>.py:<size>`."""
