"""deberta-jax: entangled (BERT) vs disentangled (DeBERTa) attention in JAX/Flax NNX."""
