"""DeBERTa (v2/v3 style): disentangled attention with log-bucketed relative positions, no absolute input.

    python train.py --config configs/deberta.py:tiny --workdir runs/deberta_tiny \
        --config.data.train_files=corpus/train.txt \
        --config.data.eval_files=corpus/valid.txt

Sizes: micro (tests), tiny, small, base (see configs/common.py).

The relative table follows the training length: `max_relative_positions = seq_len` and
`position_buckets = seq_len // 2` (linked, so `--config.data.seq_len=256` moves them too). Base
(seq_len 512) gets the paper's 256 buckets / 512 positions. At smaller sizes the paper's values would
leave most of the table untrained (a length-128 run never sees |i - j| >= 128), and at evaluation
lengths past training the clamped distances would read those untrained rows; scaling the table
with seq_len means every row reachable at any evaluation length was trained. Override either
field to study the paper's fixed table.
"""

from configs import common


def get_config(size: str = "tiny"):
    config = common.get_base_config(size)
    seq_len = config.data.get_ref("seq_len")
    # ModelConfig's defaults are DeBERTa's (disentangled c2p|p2c, no absolute input, no EMD, shared keys, LayerNorm'd
    # relative table, epsilon 1e-7); only the relative table differs, following the training length.
    # A derived reference, not `seq_len` itself: overriding max_relative_positions must not move the training length.
    config.model.max_relative_positions = seq_len.identity()
    config.model.position_buckets = seq_len // 2
    return config
