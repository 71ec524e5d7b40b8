"""Trained workdirs out to the transformers ecosystem: `writer` (a workdir's model and tokenizer as a
`save_pretrained` directory that `AutoModelForMaskedLM` and `AutoTokenizer` read).

May import data, kernels, model and train; nothing from study. `python -m deberta_jax.export` is its entry point.
"""
