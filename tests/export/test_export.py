"""Export to transformers: `AutoModelForMaskedLM` / `AutoTokenizer` on the exported directory give this project's
token ids and logits, `hf.load` reads transformers' re-save back to the same parameters, what transformers cannot
express is refused by field name, and each warning's length is where the two really part.

Models are micro-sized with weights large enough that attention is far from uniform (`initializer_range`), and
every bias and LayerNorm parameter is moved off its initial value, so a weight exported under the wrong name
changes the logits. The tolerance is that of tests/model/test_hf_reference.py (1e-5; observed at most about 2e-6 at
logits of std ~1).
"""

import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from ml_collections import config_dict

from deberta_jax.data.tokenizer import SpecialIds, save_tokenizer, train_tokenizer
from deberta_jax.export import writer
from deberta_jax.model import hf, positions
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM, with_options
from deberta_jax.train import checkpoint
from deberta_jax.train.steps import TrainState
from tests.helpers import BROWN, files_after_kills, model_params

TOL = 1e-5
MICRO = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, hidden_dropout=0.0,
             attention_dropout=0.0, initializer_range=0.15, max_position_embeddings=64)
# Entangled models without DeBERTa's position terms, as a transformers config describes them, so that the model
# hf.load reads back has this very config (and its logits come from the same compiled program).
BERT = dict(attention="entangled", position_biased_input=True, layer_norm_eps=1e-12, pos_att_type=())
CASES = {
    "bert_token_types": dict(BERT, type_vocab_size=2),
    "bert": BERT,  # transformers' BERT always adds a token type: the export writes a zero row
    # ModelConfig's defaults are DeBERTa-v3's settings: 256 log buckets, shared position projections, LayerNorm'd
    # relative table, no absolute positions, no token types (and the clamp, which agrees up to 512 tokens).
    "deberta_v3": {},
    # v2-style: separate position projections, no buckets (length 40 > max_relative_positions reads row 0 on both
    # sides, as the clamp is off), absolute positions at the input and token types.
    "deberta_v2_token_types": dict(position_buckets=0, max_relative_positions=16, share_att_key=False,
                                   norm_rel_ebd="none", clamp_relative_positions=False, position_biased_input=True,
                                   type_vocab_size=2),
    "no_positions": dict(attention="entangled", pos_att_type=()),  # DeBERTa-v2 without relative attention
}
_logits = nnx.jit(lambda model, ids, mask, types: model.mlm_logits(ids, mask, types))


@pytest.fixture(scope="module")
def lines():
    with open(f"{BROWN}/train.txt", encoding="utf-8") as f:
        return f.read(20_000).splitlines()


@pytest.fixture(scope="module")
def tokenizer(lines):
    return train_tokenizer(lines, 200)


def random_model(tokenizer, seed=0, **fields) -> MaskedLM:
    """A micro model with random weights, every bias and LayerNorm parameter moved off its usual 0 / 1. Drawn
    with numpy into an abstract model: initializing one compiles a program per parameter shape."""
    cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), **MICRO, **fields)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MaskedLM(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        name = str(path[-1].key)
        return jnp.asarray(1 + 0.3 * noise if name == "scale" else 0.3 * noise if name.endswith("bias")
                           else cfg.initializer_range * noise)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def transformers_batch(out, texts, type_vocab_size):
    """`texts` through the exported tokenizer, right-padded, with random token types when the model has them."""
    encoded = transformers.AutoTokenizer.from_pretrained(out)(texts, padding=True, return_tensors="np")
    ids, mask = encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)
    types = (np.random.default_rng(1).integers(0, type_vocab_size, ids.shape).astype(np.int32)
             if type_vocab_size else None)
    return ids, mask, types


def max_error(reference, model, ids, mask, types):
    """Max |logits(model) - reference| at real tokens; `reference` is a torch model or logits."""
    if isinstance(reference, torch.nn.Module):
        with torch.no_grad():
            reference = reference(input_ids=torch.tensor(ids, dtype=torch.long),
                                  attention_mask=torch.tensor(mask, dtype=torch.long),
                                  token_type_ids=None if types is None else torch.tensor(types, dtype=torch.long)
                                  ).logits.numpy()
    ours = np.asarray(_logits(model, ids, mask, types))
    assert ours.shape == reference.shape and np.isfinite(ours).all()
    return float(np.abs(ours - reference)[mask.astype(bool)].max())


@pytest.mark.filterwarnings("ignore::deberta_jax.model.hf.ExportWarning")  # deberta_v3's clamp; its own test below
@pytest.mark.parametrize("name", sorted(CASES))
def test_transformers_reads_the_export_and_hf_load_reads_it_back(tmp_path, tokenizer, lines, name):
    model = random_model(tokenizer, **CASES[name])
    writer.export_model(model, tokenizer, tmp_path / "export")
    texts = [" ".join(line.split()[:words]) for line, words in zip(lines, (12, 3, 1))]  # a padded batch
    ids, mask, types = transformers_batch(tmp_path / "export", texts, model.cfg.type_vocab_size)
    ours = [e.ids for e in tokenizer.encode_batch(texts)]
    assert [list(row[m > 0]) for row, m in zip(ids, mask)] == ours
    assert 16 < ids.shape[1] <= 64 and mask.sum(1).min() < ids.shape[1] // 2  # past the v2 case's 16 distances

    reference = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "export").eval()
    assert type(reference).__name__ == hf._ARCHITECTURES[hf.family_of(model.cfg)]
    assert max_error(reference, model, ids, mask, types) <= TOL

    # Round trip: transformers' own save, read back by hf.load, is this model again: the same parameters (plus
    # BERT's zero token-type row) under the same transformers config, with transformers' unclamped distances
    # (which change nothing at these lengths), and so the same logits.
    reference.save_pretrained(tmp_path / "resaved")
    back = hf.load(tmp_path / "resaved")
    assert hf.config_to_hf(back.cfg) == hf.config_to_hf(model.cfg)
    expected = model_params(model)
    if back.cfg.type_vocab_size != model.cfg.type_vocab_size:
        expected[hf._TOKEN_TYPES] = np.zeros((1, model.cfg.hidden_size), np.float32)
    got = model_params(back)
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    back = with_options(back, clamp_relative_positions=model.cfg.clamp_relative_positions)
    assert max_error(np.asarray(_logits(model, ids, mask, types)), back, ids, mask, types) <= TOL


@pytest.mark.parametrize("fields", [
    dict(position_buckets=8, max_relative_positions=16),
    dict(position_buckets=0, max_relative_positions=16),
])
def test_clamp_warning_names_the_length_where_transformers_parts(fields):
    """The warning's length is the last one at which the clamped and unclamped relative indices agree."""
    cfg = ModelConfig(**fields)
    (note,) = hf.export_differences(cfg)
    assert "clamp_relative_positions" in note and "up to 16 tokens" in note

    def index(n, clamp):
        return positions.relative_index_by_distance(n, n, position_buckets=cfg.position_buckets,
                                                    max_relative_positions=16, clamp=clamp)
    assert np.array_equal(index(16, True), index(16, False))
    assert not np.array_equal(index(17, True), index(17, False))
    assert hf.export_differences(ModelConfig(**fields, clamp_relative_positions=False)) == []
    (note,) = hf.export_differences(ModelConfig(**fields, clamp_relative_positions=False, dtype="bfloat16"))
    assert "bfloat16 rounding at every length" in note


def write_workdir(root, model, tokenizer, num_steps=None):
    """A workdir as train.py leaves it, as far as `load_workdir` reads it: config, tokenizer, one checkpoint (step
    1, of `num_steps` when given)."""
    config = {"model": model.cfg.to_dict()} | ({"train": {"num_steps": num_steps}} if num_steps else {})
    checkpoint.write_config(root, config_dict.ConfigDict(config))
    save_tokenizer(tokenizer, root / checkpoint.TOKENIZER_FILE)
    params = nnx.to_pure_dict(nnx.state(model))
    state = TrainState(step=jnp.asarray(1, jnp.int32), params=params, opt_state=optax.adam(1e-3).init(params))
    checkpoint.save(checkpoint.checkpoint_manager(root), state)
    return root


@pytest.mark.slow  # a subprocess imports jax and orbax again
def test_command_line_exports_a_workdir_and_warns_where_its_absolute_policy_leaves_transformers(
        tmp_path, tokenizer, lines):
    """BERT trained at 24 tokens with the 'clip' policy: transformers reads the table's allocated rows instead
    (the 'untrained' policy), so past 24 tokens its logits are those of 'untrained', not of this model."""
    model = random_model(tokenizer, **BERT, trained_length=24, absolute_position_policy="clip")
    workdir = write_workdir(tmp_path / "run", model, tokenizer)
    out = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "deberta_jax.export", "--workdir", str(workdir), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(writer.EXPORTED_FILES)
    assert re.search(r"absolute_position_policy='clip'.*up to 24 tokens", result.stderr)
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == SpecialIds.from_tokenizer(tokenizer).pad

    reference = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    ids, mask, types = transformers_batch(out, [" ".join(lines[0].split()[:12])], 0)
    assert ids.shape[1] > 24
    assert max_error(reference, with_options(model, absolute_position_policy="untrained"), ids, mask, types) <= TOL
    assert max_error(reference, model, ids, mask, types) > 1e-2


def test_an_unfinished_run_is_exported_with_a_note_saying_so(tmp_path, tokenizer):
    model = random_model(tokenizer, trained_length=24)
    notes = writer.export_workdir(write_workdir(tmp_path / "run", model, tokenizer, num_steps=300), tmp_path / "out")
    assert notes[-1].startswith(f"exported step 1 of the 300 that {tmp_path / 'run'} is configured to train")
    finished = writer.export_workdir(write_workdir(tmp_path / "done", model, tokenizer, num_steps=1), tmp_path / "o2")
    assert not any("configured to train" in note for note in finished)
    assert json.loads((tmp_path / "out" / "config.json").read_text())[hf.TRAINED_LENGTH_KEY] == 24


@pytest.mark.parametrize("fields, field", [
    (dict(attention="rope"), "attention"),
    (dict(attention="alibi"), "attention"),
    (dict(attention="t5_bias"), "attention"),
    (dict(attention="kerple_log"), "attention"),
    (dict(score_bias="kerple_log"), "score_bias"),
    (dict(use_emd=True), "use_emd"),
    (dict(position_biased_input=True, absolute_embedding="sinusoidal"), "absolute_embedding"),
    (dict(attention="entangled", position_biased_input=True, randomized_positions=True), "randomized_positions"),
    (dict(layer_norm_placement="pre"), "layer_norm_placement"),
    # A window below the training length changes the logits at the training length itself.
    (dict(trained_length=32, attention_window=4), "attention_window"),
    (dict(trained_length=32, attention_temperature="log_length"), "attention_temperature"),
    (dict(attention_weights="sigmoid"), "attention_weights"),
])
def test_what_transformers_cannot_express_is_refused_by_field(fields, field):
    with pytest.raises(hf.ExportError, match=rf"model\.{field}="):
        hf.config_to_hf(ModelConfig(**fields))


def test_a_refused_model_writes_nothing_and_every_reason_is_named(tmp_path, tokenizer):
    model = random_model(tokenizer, use_emd=True, layer_norm_placement="pre")
    with pytest.raises(hf.ExportError, match=r"model\.use_emd=True .*; model\.layer_norm_placement='pre'"):
        writer.export_model(model, tokenizer, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_every_exported_file_gets_the_same_permissions(tmp_path, tokenizer):
    """Readable by whoever may read config.json (the weights were once written 0600, unreadable to a team)."""
    writer.export_model(random_model(tokenizer), tokenizer, tmp_path / "export")
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "export").iterdir()}
    assert len(set(modes.values())) == 1, modes


@pytest.mark.slow  # three export subprocesses, two of them killed
def test_a_killed_export_leaves_the_previous_one_whole_and_the_rerun_completes(tmp_path, tokenizer):
    """SIGKILL at two moments of an export over an earlier one, then the same command again: every file of `out`
    is at all times either the earlier export's or the new one's, nothing is left beside it, and the rerun
    writes the new model."""
    old, new = random_model(tokenizer, seed=1), random_model(tokenizer, seed=2)
    out = tmp_path / "export"
    writer.export_model(old, tokenizer, out)
    earlier = {name: (out / name).read_bytes() for name in writer.EXPORTED_FILES}
    workdir = write_workdir(tmp_path / "run", new, tokenizer)
    command = [sys.executable, "-m", "deberta_jax.export", "--workdir", str(workdir), "--out", str(out)]
    # Import, load and write take ~5-8 s here.
    after_kills = files_after_kills(command, np.random.default_rng(0).uniform(2.0, 6.0, size=2), out)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "run"]  # no temporary left beside it
    final = {name: (out / name).read_bytes() for name in writer.EXPORTED_FILES}
    for files in after_kills:  # never a torn file: each one the earlier export's or the new one's
        assert set(files) == set(writer.EXPORTED_FILES)
        assert all(files[name] in (earlier[name], final[name]) for name in files)
    exported = hf.load(out)
    np.testing.assert_array_equal(np.asarray(exported.embeddings.word_embeddings[...]),
                                  np.asarray(new.embeddings.word_embeddings[...]))


def test_out_dir_with_other_files_is_refused(tmp_path, tokenizer):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileExistsError, match="pytorch_model.bin"):
        writer.export_model(random_model(tokenizer), tokenizer, tmp_path)
