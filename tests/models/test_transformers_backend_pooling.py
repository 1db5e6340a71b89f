"""Pooling models through the transformers backend (transformers' own class, each prompt run whole on its own
attention), for encoders llmplug has no native row for: a sentence-transformers ELECTRA folder embeds as
sentence-transformers does (mean pooling, normalized; within 1e-5); MPNet's bare model, RoBERTa forced through the
backend and GPT-1's bare decoder (last-token pooling) embed as transformers; DeBERTa-v2 (disentangled attention,
which the attention interface does not carry) and ELECTRA classifiers give transformers' logits, the latter on text
pairs with token types; a classifier whose head does not pool the prompt itself is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DebertaV2Config, DistilBertConfig, ElectraConfig, MPNetConfig, OpenAIGPTConfig, RobertaConfig

from llmplug import LLM
from llmplug.core.config import EngineConfig
from llmplug.core.errors import LlmplugError
from llmplug.loaders.default import DefaultLoader
from llmplug.plugins.models.transformers_backend import (
    TransformersEncoderForEmbedding,
    TransformersEncoderForSequenceClassification,
)
from llmplug.plugins.models.transformers_backend.encoder import prompt_spans
from llmplug.testing import PoolingParityCase, PoolingParityRunner
from llmplug.testing.parity import BASE_ENGINE_KWARGS
from llmplug.testing.tiny import tiny_config

WORDS = "the a cat dog sat on mat ran fast slow red blue big small house tree bird sang today".split()
SENTENCES = ["the cat sat on the mat", "a dog ran fast", "red bird sang today", "the big blue house",
             "a small tree", "dog"]
FLOAT32 = {**BASE_ENGINE_KWARGS, "dtype": "float32", "skip_tokenizer_init": False}


def model_class(path: Path, model_impl: str = "auto") -> type:
    """The class the engine's loader picks for the checkpoint at `path`."""
    loader = DefaultLoader(EngineConfig().load)
    return loader.get_model_class(loader.load_hf_config(EngineConfig(model={"model": str(path)}).model), model_impl)


# a sentence-transformers folder as the hub holds them: modules.json, the pooling module's config, Normalize
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


@pytest.fixture(scope="module")
def electra_sentence_transformers_folder(tmp_path_factory):
    """A tiny random ELECTRA discriminator with a WordPiece vocabulary, saved as a sentence-transformers folder
    (mean pooling, normalized); (path, the transformers model, its tokenizer)."""
    from transformers import BertTokenizerFast, ElectraModel

    path = tmp_path_factory.mktemp("electra_st")
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    config = tiny_config(ElectraConfig, vocab_size=len(tokenizer), embedding_size=32, pad_token_id=0,
                         architectures=["ElectraModel"])
    torch.manual_seed(0)
    model = ElectraModel(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps(MODULES))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}))
    (path / "2_Normalize").mkdir()
    return path, model, tokenizer


def sentence_transformers_embeddings(model, tokenizer, sentences: list[str]) -> torch.Tensor:
    """What sentence-transformers computes for the folder: the batch padded, the mean of each sentence's token
    rows under its attention mask, L2-normalized."""
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # [B, L, H]
    mask = batch["attention_mask"][..., None].float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_a_sentence_transformers_folder_of_an_encoder_without_a_native_row_embeds_as_sentence_transformers(
    electra_sentence_transformers_folder,
) -> None:
    path, model, tokenizer = electra_sentence_transformers_folder
    assert model_class(path) is TransformersEncoderForEmbedding
    llm = LLM(str(path), **FLOAT32, max_num_batched_tokens=16)  # several prompts a step, over several steps
    try:
        assert llm.llm_engine.pooling.pooling_type == "MEAN"  # from 1_Pooling/config.json, not the CLS default
        outputs = llm.embed(SENTENCES, use_tqdm=False)
    finally:
        llm.shutdown()
    got = torch.stack([torch.tensor(o.outputs.embedding) for o in outputs])
    expected = sentence_transformers_embeddings(model, tokenizer, SENTENCES)
    assert [o.prompt_token_ids for o in outputs] == [tokenizer(s)["input_ids"] for s in SENTENCES]
    assert float((got - expected).abs().max()) <= 1e-5


CLASSIFIER_CASES = [
    PoolingParityCase(  # disentangled relative attention: not the attention interface's, run on its own
        "TransformersEncoderForSequenceClassification-deberta_v2",
        lambda: tiny_config(DebertaV2Config, num_labels=3, relative_attention=True, position_buckets=8,
                            pos_att_type=["p2c", "c2p"], pooler_hidden_size=64, type_vocab_size=0,
                            architectures=["DebertaV2ForSequenceClassification"]),
        engine_kwargs={"dtype": "float32"}, atol=1e-5),
    PoolingParityCase(  # a cross-encoder: one label, text pairs with token types
        "TransformersEncoderForSequenceClassification-electra",
        lambda: tiny_config(ElectraConfig, num_labels=1, embedding_size=32,
                            architectures=["ElectraForSequenceClassification"]),
        engine_kwargs={"dtype": "float32"}, token_types=True, atol=1e-5),
]


@pytest.mark.parametrize("case", CLASSIFIER_CASES, ids=lambda c: c.name.split("-")[1])
def test_classifiers_of_encoders_without_a_native_row_give_transformers_logits(tmp_path_factory, case) -> None:
    runner = PoolingParityRunner(tmp_path_factory.mktemp("backend_classifiers"))
    path, _ = runner.checkpoint(case)
    assert model_class(path) is TransformersEncoderForSequenceClassification
    report = runner.check(case)
    assert report.task == "classify" and report.max_diff <= 1e-5


def test_an_encoder_without_a_native_row_embeds_as_transformers(tmp_path_factory) -> None:
    case = PoolingParityCase(  # MPNet (all-mpnet-base-v2's): a relative position bias, not the attention interface
        "TransformersEncoderForEmbedding-mpnet",
        lambda: tiny_config(MPNetConfig, pad_token_id=1, architectures=["MPNetModel"]),
        engine_kwargs={"dtype": "float32"}, atol=1e-5)
    runner = PoolingParityRunner(tmp_path_factory.mktemp("backend_mpnet"))
    path, _ = runner.checkpoint(case)
    assert model_class(path) is TransformersEncoderForEmbedding
    report = runner.check(case)
    assert report.task == "embed" and report.max_diff <= 1e-5


def test_a_native_encoder_forced_through_the_backend_embeds_as_transformers(tmp_path_factory) -> None:
    case = PoolingParityCase(  # RoBERTa's positions start after its padding index: transformers' own count them
        "TransformersEncoderForEmbedding-roberta",
        lambda: tiny_config(RobertaConfig, pad_token_id=1, architectures=["RobertaModel"]),
        engine_kwargs={"dtype": "float32", "model_impl": "transformers"}, atol=1e-5)
    runner = PoolingParityRunner(tmp_path_factory.mktemp("backend_roberta"))
    path, _ = runner.checkpoint(case)
    assert model_class(path, "transformers") is TransformersEncoderForEmbedding
    assert model_class(path) is not TransformersEncoderForEmbedding  # auto: RoBERTa is native
    report = runner.check(case)
    assert report.task == "embed" and report.max_diff <= 1e-5


def test_a_bare_decoder_without_the_attention_interface_embeds_its_last_token_as_transformers(
    tmp_path_factory,
) -> None:
    case = PoolingParityCase(  # GPT-1's attention is not the interface's: run whole on its own
        "TransformersEncoderForEmbedding-openai_gpt",
        lambda: tiny_config(OpenAIGPTConfig, architectures=["OpenAIGPTModel"]),
        engine_kwargs={"dtype": "float32"}, atol=1e-5)
    runner = PoolingParityRunner(tmp_path_factory.mktemp("backend_gpt"))
    path, hf_model = runner.checkpoint(case)
    assert model_class(path) is TransformersEncoderForEmbedding
    llm = LLM(str(path), **BASE_ENGINE_KWARGS)
    try:
        (out,) = llm.embed([{"prompt_token_ids": [5, 9, 17, 33]}], use_tqdm=False)
    finally:
        llm.shutdown()
    with torch.inference_mode():
        last = hf_model(torch.tensor([[5, 9, 17, 33]])).last_hidden_state[0, -1]
    assert torch.allclose(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(last, dim=-1), atol=1e-5)
    report = runner.check(case)
    assert report.task == "embed" and report.max_diff <= 1e-5


def test_a_step_splits_into_whole_prompts_at_position_zero_and_a_chunk_is_refused() -> None:
    assert prompt_spans(torch.tensor([0, 1, 2, 0, 0, 1])) == [(0, 3), (3, 4), (4, 6)]
    with pytest.raises(ValueError, match="must start a prompt"):
        prompt_spans(torch.tensor([3, 4, 0, 1]))
    with pytest.raises(ValueError, match="not one whole prompt"):
        prompt_spans(torch.tensor([0, 1, 5]))


def test_a_classifier_whose_head_does_not_pool_the_prompt_is_refused_by_name(tmp_path) -> None:
    from transformers import DistilBertForSequenceClassification

    config = tiny_config(DistilBertConfig, dim=64, hidden_dim=128, n_layers=1, n_heads=4,
                         architectures=["DistilBertForSequenceClassification"])
    DistilBertForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(LlmplugError, match=r"DistilBertForSequenceClassification's head is \['pre_classifier', "
                                           r"'classifier'\]"):
        LLM(str(tmp_path), **FLOAT32)
