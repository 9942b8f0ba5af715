"""A tiny random BERT saved as BertForMaskedLM (`bert.` prefix, MLM head to skip; no modules.json, so the
default CLS pooling) against transformers' BertModel, and the encoder's config checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertModel

from engine_fixtures import run_cache_dir

from jaxserve.llm import LLM
from jaxserve.models.bert import EncoderConfig
from jaxserve.pooling_params import PoolingParams

PROMPTS = [[2, 17, 33, 90, 3], [2, 5, 3], list(range(4, 70)), [2] + list(range(100, 140)) + [3]]


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_cls_pooling_equals_hf(tmp_path, hidden_act):
    cfg = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=128, hidden_act=hidden_act)  # fmt: skip
    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(tmp_path)
    hf = BertModel.from_pretrained(tmp_path, add_pooling_layer=False, attn_implementation="eager").eval()
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=128, compilation_cache_dir=run_cache_dir(), precompile="none",
              skip_tokenizer_init=True, use_tqdm_on_load=False)  # fmt: skip
    info = llm.llm_engine.info()
    assert (info["runner"], info["pooling_type"], info["normalize"]) == ("pooling", "cls", True)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).last_hidden_state[0, 0].numpy()
        np.testing.assert_allclose(out.outputs.embedding, want, rtol=1e-4, atol=1e-5)


def test_encoder_config_rejects_what_it_cannot_run():
    base = dict(model_type="bert", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="position_embedding_type='relative_key' is not supported"):
        EncoderConfig.from_hf_config({**base, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act='relu' is not supported"):
        EncoderConfig.from_hf_config({**base, "hidden_act": "relu"})


@pytest.mark.parametrize("arch", ["roberta", "xlm-roberta"])
def test_roberta_positions_start_after_padding(tmp_path, arch):
    from transformers import AutoModel, RobertaConfig, RobertaForMaskedLM, XLMRobertaConfig, XLMRobertaForMaskedLM

    config_cls, mlm_cls = {"roberta": (RobertaConfig, RobertaForMaskedLM),
                           "xlm-roberta": (XLMRobertaConfig, XLMRobertaForMaskedLM)}[arch]  # fmt: skip
    cfg = config_cls(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=80, pad_token_id=1, type_vocab_size=1)  # fmt: skip
    torch.manual_seed(0)
    mlm_cls(cfg).save_pretrained(tmp_path)
    hf = AutoModel.from_pretrained(tmp_path, add_pooling_layer=False, attn_implementation="eager").eval()
    llm = LLM(str(tmp_path), dtype="float32", compilation_cache_dir=run_cache_dir(), precompile="none", skip_tokenizer_init=True,
              use_tqdm_on_load=False)  # fmt: skip
    assert llm.llm_engine.info()["max_model_len"] == 78  # 80 positions, numbered from padding_idx + 1 = 2
    prompts = [[0, 17, 33, 90, 2], list(range(3, 81))]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).last_hidden_state[0, 0].numpy()
        np.testing.assert_allclose(out.outputs.embedding, want, rtol=1e-4, atol=1e-5)
