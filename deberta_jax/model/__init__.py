"""The masked-LM encoders: `config` (ModelConfig, validated once), `positions` (bucketing, absolute-table policies,
the literature's position schemes), `parameters` (initializers), `attention` (projections and the variants' score
terms), `encoder` (embeddings, layers, MLM head, EMD) and `hf` (transformers checkpoints).

May import `deberta_jax.kernels`; nothing from data, train or study.
"""
