"""EAGLE and EAGLE-3 heads: checkpoints in the public formats (random tiny heads), drafts equal to a reference
forward written with transformers' Llama blocks, greedy output equal to plain decoding (plain, chunked
prefill, preemption), sampled output following plain sampling (the chi-square test of test_spec_decode)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from llmplug import SamplingParams
from llmplug.core.errors import ConfigError
from tests.engine.test_spec_decode import (
    NUM_SAMPLES, PROMPTS, VARIANTS, assert_no_leak, first_tokens, generate, make_llm, p_values,
)
from llmplug.testing.eagle import eagle_head_config, save_random_eagle_head
from tests.models.tiny_models import make_tiny

K = 3
GREEDY_24 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # enough steps for every path, lean
DRAFT_VOCAB = 100  # EAGLE-3's own head covers these many of the target's 256 tokens


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer Llama: EAGLE-3's default layers (2, L // 2, L - 3) are 2, 2 and 1."""
    return make_tiny("llama", tmp_path_factory.mktemp("eagle_target"), overrides={"num_hidden_layers": 4})


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory) -> dict:
    out = {}
    for method in ("eagle", "eagle3"):
        path = tmp_path_factory.mktemp(method)
        out[method] = (path, save_random_eagle_head(path, target.hf_model.config, method, DRAFT_VOCAB))
    return out


def spec(heads, method: str) -> dict:
    return {"method": method, "model": str(heads[method][0]), "num_speculative_tokens": K}


# --- the drafts are the head's: a reference forward with transformers' Llama blocks ------------------

def reference_drafts(target, method: str, weights: dict[str, torch.Tensor], prompt: list[int]) -> list[int]:
    """The K greedy drafts after the prompt and the target's first greedy token, recomputing the whole
    sequence at every draft position (no cache) with transformers' decoder layer, attention and rotary."""
    model = target.hf_model
    config = eagle_head_config(model.config, method, DRAFT_VOCAB)
    config._attn_implementation = "sdpa"
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
        first = int(out.logits[0, -1].argmax())
        if method == "eagle":
            hidden = out.hidden_states[-1][0]  # the target's last hidden states, after its final norm
        else:
            hidden = torch.cat([out.hidden_states[i][0] for i in (2, 2, 1)], dim=-1)  # inputs of layers 2, 2, 1
        step = Eagle1Reference(config, weights) if method == "eagle" else Eagle3Reference(config, weights)
        tokens, states, drafts = prompt[1:] + [first], step.reduce(hidden), []
        for _ in range(K):
            normed, stream = step(model.model.embed_tokens(torch.tensor(tokens)), states)
            logits = model.lm_head(normed[-1]) if method == "eagle" else step.logits(normed[-1])
            drafts.append(int(logits.argmax()))
            tokens, states = tokens + [drafts[-1]], torch.cat([states, stream[-1:]])
    return drafts


class Eagle1Reference(torch.nn.Module):
    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.layer = LlamaDecoderLayer(config, 0)
        self.layer.input_layernorm = torch.nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)
        self.fc.load_state_dict({"weight": weights["fc.weight"], "bias": weights["fc.bias"]})
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in weights.items() if k.startswith("layers.0.")})

    def reduce(self, hidden):
        return hidden

    def forward(self, embeds, hidden):
        x = self.fc(torch.cat([embeds, hidden], dim=-1))[None]
        positions = torch.arange(x.shape[1])[None]
        out = self.layer(x, position_embeddings=self.rotary(x, positions), position_ids=positions)[0]
        return out, out


class Eagle3Reference(torch.nn.Module):
    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        H = config.hidden_size
        self.layer = LlamaDecoderLayer(config, 0)  # its attention's q/k/v read [embedding | hidden]
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.layer.self_attn, name)
            setattr(self.layer.self_attn, name, torch.nn.Linear(2 * H, old.out_features, bias=False))
        self.hidden_norm = type(self.layer.input_layernorm)(H, eps=config.rms_norm_eps)
        self.norm = type(self.layer.input_layernorm)(H, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.fc = torch.nn.Linear(3 * H, H, bias=False)
        self.lm_head = torch.nn.Linear(H, DRAFT_VOCAB, bias=False)
        self.layer.load_state_dict({k[len("midlayer."):]: v for k, v in weights.items()
                                    if k.startswith("midlayer.") and "hidden_norm" not in k})
        self.hidden_norm.weight.data.copy_(weights["midlayer.hidden_norm.weight"])
        self.norm.weight.data.copy_(weights["norm.weight"])
        self.fc.weight.data.copy_(weights["fc.weight"])
        self.lm_head.weight.data.copy_(weights["lm_head.weight"])
        self.d2t = weights["d2t"]

    def reduce(self, hidden):
        return self.fc(hidden)

    def forward(self, embeds, hidden):
        layer = self.layer
        x = torch.cat([layer.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)[None]
        positions = torch.arange(x.shape[1])[None]
        attn = layer.self_attn(x, position_embeddings=self.rotary(x, positions), attention_mask=None)[0][0]
        stream = hidden + attn
        stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
        return self.norm(stream), stream

    def logits(self, normed):
        """Over the target's vocabulary: draft token i is target token i + d2t[i]; the others cannot be drafted."""
        logits = torch.full((256,), float("-inf"))
        logits[torch.arange(DRAFT_VOCAB) + self.d2t] = self.lm_head(normed)
        return logits


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_a_reference_forward_of_the_head(method, target, heads):
    llm = make_llm(target.path, speculative_config=spec(heads, method))
    engine = llm.llm_engine
    prompt = PROMPTS[3]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # the prefill: the target samples its first token, the head drafts the next K
    drafts = engine.engine_core.scheduler.speculator.proposer.latest["r"]
    assert drafts == reference_drafts(target, method, heads[method][1], prompt)
    engine.abort_request(["r"])


# --- exactness ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_greedy(target) -> list[list[int]]:
    return generate(make_llm(target.path), GREEDY_24)


@pytest.mark.parametrize("method,variant", [(m, v) for m in ("eagle", "eagle3") for v in VARIANTS])
def test_greedy_output_equals_plain_decoding(method, variant, target, heads, plain_greedy):
    expected = plain_greedy
    llm = make_llm(target.path, speculative_config=spec(heads, method), **VARIANTS[variant])
    assert generate(llm, GREEDY_24) == expected
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0  # random heads: few or none accepted, all verified
    if variant == "preemption":
        assert stats["num_preemptions"] > 0
    assert_no_leak(llm)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_sampled_first_tokens_follow_plain_sampling(method, target, heads):
    prompt = PROMPTS[0]
    plain = first_tokens(make_llm(target.path, max_num_seqs=256), prompt, first_seed=0)
    llm = make_llm(target.path, max_num_seqs=256, speculative_config=spec(heads, method))
    samples = first_tokens(llm, prompt, first_seed=100_000)
    assert llm.stats()["spec_decode_num_draft_tokens"] >= NUM_SAMPLES
    assert min(p_values(plain, samples)) > 0.01 / 4


# --- refusals -------------------------------------------------------------------------------------

def test_a_head_for_another_target_is_refused_and_names_the_sizes(heads, tmp_path_factory):
    other = make_tiny("llama", tmp_path_factory.mktemp("other"), overrides={"hidden_size": 32, "num_hidden_layers": 4})
    with pytest.raises(ConfigError, match="hidden states of 64 features"):
        make_llm(other.path, speculative_config=spec(heads, "eagle"))


def test_eagle3_layers_outside_the_target_are_refused(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("bad_aux")
    save_random_eagle_head(path, target.hf_model.config, "eagle3", DRAFT_VOCAB)
    config = json.loads((path / "config.json").read_text()) | {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        make_llm(target.path, speculative_config={"method": "eagle3", "model": str(path), "num_speculative_tokens": 2})
