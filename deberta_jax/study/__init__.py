"""Experiments on trained models: `scoring` (scoring windows into per-document sums, bootstrap intervals),
`length_study` (models x datasets x policies x lengths x protocols), `reference` (the unigram floor and the
exact oracle of synthetic tasks),
`report` (tables and plots) and `sweep` (ablation sweeps: train, evaluate, report).

May import every other layer. `eval.py` and `python -m deberta_jax.study.sweep` are its entry points.
"""
