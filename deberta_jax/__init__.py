"""deberta-jax: entangled (BERT) vs disentangled (DeBERTa) attention in JAX/Flax NNX.

Subpackages follow the import layers, each importing only from the ones before it:

    storage  every path a user gives, on a disk or in a bucket; whole-file writes; locks' conditional writes
    data     corpora, tokenizer, packing, masking, batches, evaluation targets   (numpy; -> storage)
    kernels  how attention scores are formed from their terms and become outputs: dense, blockwise, Pallas
    model    ModelConfig, positions, attention variants, the encoder, transformers checkpoints   (-> kernels)
    train    train/eval steps, optimizer, sharding, checkpoints, metrics, config validation   (-> data, model)
    study    scoring windows, the length study, reference models, reports, sweeps   (-> data, model, train)
    export   a trained workdir as a transformers checkpoint   (-> data, model, train)

`train.py` and `eval.py` at the repository root are the entry points, with `python -m deberta_jax.export`;
`tests/test_architecture.py` checks the layering.
"""
