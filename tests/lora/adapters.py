"""Random PEFT LoRA adapters over the tiny test checkpoints, saved by peft itself, and peft's merged model
(the reference: base weights plus scaling * B @ A, merged by peft)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from llmplug.lora import LoRARequest

# (name, rank, alpha, rsLoRA, target modules): ranks 8 and 16, attention only, MLP only, everything
SPECS = {
    "qv8": (8, 16, False, ("q_proj", "v_proj")),
    "mlp16": (16, 8, True, ("gate_proj", "up_proj", "down_proj", "o_proj")),
    "all8": (8, 32, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "kv16": (16, 16, False, ("k_proj", "v_proj", "up_proj")),
    "od8": (8, 16, True, ("o_proj", "down_proj")),
}
# adapters of the vocabulary layers (PEFT's lora_embedding_A / _B on embed_tokens, lora_A / _B on lm_head)
VOCAB_SPECS = {
    "emb8": (8, 16, False, ("embed_tokens", "q_proj")),
    "head16": (16, 8, True, ("lm_head", "up_proj")),
    "both8": (8, 32, False, ("embed_tokens", "lm_head", "v_proj", "down_proj")),
}


@dataclass
class Adapter:
    """A saved adapter folder and peft's merged model of it (or peft's unmerged model, see save_adapter)."""

    name: str
    path: Path
    merged: torch.nn.Module

    def request(self, lora_int_id: int) -> LoRARequest:
        return LoRARequest(self.name, lora_int_id, str(self.path))


def save_adapter(base_path: Path, name: str, path: Path, seed: int, merge: bool = True) -> Adapter:
    """Adapter `name` of SPECS or VOCAB_SPECS over the checkpoint at `base_path`, every A and B random (std 0.1);
    `merge=False` keeps peft's model unmerged as the reference (merging an adapted embedding into a table tied
    to the LM head would change the head as well, which peft's own forward does not)."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, rslora, targets = {**SPECS, **VOCAB_SPECS}[name]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets), lora_dropout=0.0)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if any(f".lora_{m}" in param_name for m in ("A.", "B.", "embedding_A.", "embedding_B.")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(path)  # with an adapted embed_tokens / lm_head, peft saves their base tables too
    return Adapter(name, path, model.merge_and_unload().eval() if merge else model.eval())


def greedy_reference(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-softmax rows [P + N - 1, vocab] over prompt + tokens."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
        full = out[0].tolist()
        logits = model(torch.tensor([full[:-1]])).logits[0].float()
    return full[len(prompt):], torch.log_softmax(logits, dim=-1)
