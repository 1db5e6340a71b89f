"""A quantized checkpoint of a mixture-of-experts model is refused by name at load (no method holds stacked experts
in a quantized form yet), never loaded with its experts wrong; the dense checkpoint of the same model then loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import Qwen2MoeConfig

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ModelLoadError
from llmplug.testing.tiny import save_tiny_checkpoint, tiny_config

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_an_fp8_moe_checkpoint_is_refused_naming_the_experts_then_the_dense_one_loads(tmp_path: Path) -> None:
    config = tiny_config(Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32)
    dense = save_tiny_checkpoint(config, tmp_path / "dense").path
    quantized = Path(shutil.copytree(dense, tmp_path / "fp8"))
    saved = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**saved, "quantization_config": FP8}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.experts: fp8 checkpoints of mixture-of-experts"):
        LLM(str(quantized), dtype="float32", skip_tokenizer_init=True)
    llm = LLM(str(dense), dtype="float32", skip_tokenizer_init=True)
    try:
        out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
