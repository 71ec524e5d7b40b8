"""Text to model inputs, all in numpy: corpora (`text`), the WordPiece tokenizer (`tokenizer`), tokenizing a corpus
in parallel (`encoding`) into the memory-mapped on-disk cache (`store`), packing into rows and the cache's keys
(`packing`), BERT masking (`masking`), training and evaluation batches (`batches`), the
fixed targets and windows of the length protocols (`targets`), and generated corpora with known structure for
position diagnostics (`synthetic`).

Imports nothing else from deberta_jax but `storage`, through which every corpus path is read.
"""
