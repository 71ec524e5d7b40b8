"""Published checkpoints as downloaded: DeBERTa-v3's SentencePiece `spm.model` and BERT's `vocab.txt` instead of a
`tokenizer.json`, and DeBERTa-v3's discriminator, which has no masked-LM head.

Each checkpoint is a randomly initialized transformers model saved beside a tokenizer built in the test (a
SentencePiece model trained on a little Brown text with DeBERTa-v3's id layout; a vocab.txt with BERT's), so
`length_study.load_hf_checkpoint` must find the checkpoint's own special ids (not this project's 0..4), the
token ids transformers' `AutoTokenizer` gives, and logits equal to transformers' on them.
"""

import io
import json
import shutil

import numpy as np
import pytest
import sentencepiece
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from deberta_jax.data import targets
from deberta_jax.data.tokenizer import SPECIAL_TOKENS, SpecialIds, train_tokenizer
from deberta_jax.model import hf
from deberta_jax.study import length_study
from tests.helpers import BROWN
from tests.model.test_hf_reference import SMALL, TOL, V3, perturb_biases_and_norms

# DeBERTa-v3's spm.model: [PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3; [MASK] is added after the pieces.
SPM_IDS = dict(pad_id=0, pad_piece="[PAD]", bos_id=1, bos_piece="[CLS]", eos_id=2, eos_piece="[SEP]", unk_id=3,
               unk_piece="[UNK]")
BERT_SPECIAL_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}  # as in bert-base-uncased
_logits = nnx.jit(lambda model, ids, mask: model.mlm_logits(ids, mask))  # one compile instead of op-by-op


@pytest.fixture(scope="module")
def lines():
    with open(f"{BROWN}/train.txt", encoding="utf-8") as f:
        return f.read(30_000).splitlines()


def save_random_model(model_class, config_class, path, **config):
    torch.manual_seed(0)
    model = model_class(config_class(**config)).eval()
    perturb_biases_and_norms(model)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def spm_checkpoint(tmp_path_factory, lines):
    """A DeBERTa-v3-shaped checkpoint: spm.model, tokenizer_config.json as microsoft/deberta-v3-* ship it, and a
    vocabulary a little larger than the tokenizer's (128100 rows for 128001 tokens there)."""
    path = tmp_path_factory.mktemp("deberta-v3")
    spm = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=spm, vocab_size=300,
                                             model_type="unigram", minloglevel=2, **SPM_IDS)
    (path / "spm.model").write_bytes(spm.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False, "vocab_type": "spm"}))
    model = save_random_model(transformers.DebertaV2ForMaskedLM, transformers.DebertaV2Config, path,
                              **dict(V3, vocab_size=310))
    return path, model


@pytest.fixture(scope="module")
def vocab_txt_checkpoint(tmp_path_factory, lines):
    """A bert-base-uncased-shaped checkpoint: vocab.txt with the special tokens at BERT's ids, lower-casing."""
    path = tmp_path_factory.mktemp("bert")
    pieces = [t for t, _ in sorted(train_tokenizer(lines, 300).get_vocab().items(), key=lambda kv: kv[1])
              if t not in SPECIAL_TOKENS]
    for token, token_id in sorted(BERT_SPECIAL_IDS.items(), key=lambda kv: kv[1]):
        pieces.insert(token_id, token)
    (path / "vocab.txt").write_text("\n".join(pieces) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    model = save_random_model(transformers.BertForMaskedLM, transformers.BertConfig, path,
                              **dict(SMALL, vocab_size=len(pieces), max_position_embeddings=64, type_vocab_size=2))
    return path, model


def check_against_transformers(path, reference, texts):
    """The study's view of the checkpoint at `path` has transformers' special ids, token ids and logits."""
    em = length_study.load_hf_checkpoint(str(path))
    auto = transformers.AutoTokenizer.from_pretrained(path)
    special = SpecialIds.from_tokenizer(em.tokenizer)
    assert special == SpecialIds(pad=auto.pad_token_id, unk=auto.unk_token_id, cls=auto.cls_token_id,
                                 sep=auto.sep_token_id, mask=auto.mask_token_id)
    encoded = auto(texts, padding=True, return_tensors="np")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    assert [e.ids for e in em.tokenizer.encode_batch(texts)] == [list(row[m > 0]) for row, m in zip(ids, mask)]
    assert mask.sum(1).min() < ids.shape[1]  # a padded batch
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    logits = np.asarray(_logits(em.model, ids.astype(np.int32), mask.astype(np.int32)))
    assert np.abs(logits - expected)[mask > 0].max() <= TOL
    return em, special


def test_deberta_v3_spm_model_gives_the_checkpoints_ids_and_logits(spm_checkpoint, lines):
    path, reference = spm_checkpoint
    em, special = check_against_transformers(path, reference, [lines[0][:150], lines[1][:40], lines[2][:15]])
    assert (special.pad, special.cls, special.sep, special.unk, special.mask) == (0, 1, 2, 3, 300)
    # The study's targets use these ids: [SEP] between documents, no special token ever a target.
    corpus = targets.build_corpus(lines[3:8], em.tokenizer)
    assert corpus.special == special and (corpus.tokens == special.sep).sum() == 4
    assert not np.isin(corpus.tokens[corpus.targets], special.all).any() and corpus.targets.any()


def test_bert_vocab_txt_gives_the_checkpoints_ids_and_logits(vocab_txt_checkpoint, lines):
    path, reference = vocab_txt_checkpoint
    em, special = check_against_transformers(path, reference, [lines[0][:120], lines[1][:30], lines[2][:10]])
    assert special == SpecialIds(*(BERT_SPECIAL_IDS[t] for t in SPECIAL_TOKENS))
    assert em.tokenizer.encode("The JURY", add_special_tokens=False).tokens == ["the", "jury"]  # lower-cased


def test_a_directory_without_a_tokenizer_names_the_files_it_accepts(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*spm\.model.*vocab\.txt"):
        hf.load_tokenizer(tmp_path)


def test_other_special_tokens_are_refused_by_name(spm_checkpoint, tmp_path):
    """A checkpoint whose mask token is RoBERTa's <mask> has no [MASK] for the study to mask with."""
    shutil.copy(spm_checkpoint[0] / "spm.model", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "DebertaV2Tokenizer", "mask_token": "<mask>"}))
    with pytest.raises(ValueError, match=r"has no \[MASK\]"):
        length_study.load_hf_checkpoint(str(tmp_path))


def test_a_discriminator_without_a_masked_lm_head_is_refused_with_the_reason(spm_checkpoint, tmp_path):
    """DeBERTa-v3 is published as its replaced-token-detection discriminator: encoder plus mask_predictions.*."""
    tensors = load_file(spm_checkpoint[0] / hf.WEIGHTS_FILE)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("cls.")}
    hidden = V3["hidden_size"]
    tensors.update({"mask_predictions.dense.weight": np.zeros((hidden, hidden), np.float32),
                    "mask_predictions.classifier.weight": np.zeros((1, hidden), np.float32)})
    save_file(tensors, tmp_path / hf.WEIGHTS_FILE, metadata={"format": "pt"})
    shutil.copy(spm_checkpoint[0] / hf.CONFIG_FILE, tmp_path)
    with pytest.raises(hf.CheckpointError, match="replaced-token-detection"):
        hf.load(tmp_path)
