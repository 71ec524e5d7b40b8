"""BERT: entangled attention over word + learned absolute position embeddings.

    python train.py --config configs/bert.py:tiny --workdir runs/bert_tiny \
        --config.data.train_files=corpus/train.txt \
        --config.data.eval_files=corpus/valid.txt

Sizes: micro (tests), tiny, small, base (see configs/common.py).
"""

from configs import common


def get_config(size: str = "tiny"):
    config = common.get_base_config(size)
    config.model.attention = "entangled"
    config.model.position_biased_input = True
    config.model.layer_norm_eps = 1e-12
    # The absolute table keeps its default 512 rows whatever seq_len is: rows past the training length exist
    # (untrained) so that length-extrapolation evaluation can compare the position policies.
    return config
