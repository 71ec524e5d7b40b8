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
    config.model.attention = "disentangled"
    config.model.position_biased_input = False
    config.model.layer_norm_eps = 1e-7
    config.model.pos_att_type = "c2p|p2c"
    # A derived reference, not `seq_len` itself: overriding max_relative_positions must not move the training length.
    config.model.max_relative_positions = seq_len.identity()
    config.model.position_buckets = seq_len // 2
    config.model.share_att_key = True
    config.model.norm_rel_ebd = "layer_norm"
    config.model.clamp_relative_positions = True
    config.model.use_emd = False
    return config
