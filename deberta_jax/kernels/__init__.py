"""Attention kernels: how score terms become attention outputs, independent of the position scheme.

`scores` holds the score terms every kernel takes (`ScoreTerms`: queries, keys, DeBERTa's c2p/p2c products, a
per-distance bias) with the score formula, the scale and the key-masking rule written once; `dense`, `blockwise`,
`pallas` (GPU) and `pallas_tpu` are the kernels; `dispatch` picks one by name; `dropout_masks` draws the masks the
kernels and the model use.

Imports nothing else from deberta_jax: the model layer builds `ScoreTerms` and calls a kernel.
"""
