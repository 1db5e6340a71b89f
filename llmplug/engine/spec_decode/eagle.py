"""EAGLE drafting in the model runner: after each step's target forward, an EAGLE or EAGLE-3 head drafts every
sampling request's next tokens from the target's hidden states; the next step verifies them.

Per step, the head first runs over the positions the target just computed and kept (a prefill chunk, or
the last token and the accepted drafts), each reading its target hidden state and the token after it
(the one sampled, for the last); that writes the head's K/V there and drafts the first token. Each further
draft position is one forward of the head for all requests at once, reading the draft before it and the
head's own output state. Drafts are greedy (the head's argmax): certain, so the rejection sampler's rule
for one-hot draft distributions keeps sampled requests exact.

The head's attention keeps its own KV cache in the target's block layout: position p of a request lives
in the same block and slot of both caches, so the target's block tables and slot mappings serve the head.
Draft positions past a request's allocated blocks write scratch blocks kept after the shared ones (a few
per batch row); their K/V only serve the draft positions after them, and a position's K/V is always
rewritten from the target's hidden state before a later step reads it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from llmplug.engine.spec_decode.eagle_head import EagleHead, load_eagle_head
from llmplug.layers.attention import Attention, bind_kv_cache
from llmplug.layers.decoder.model import DecoderForCausalLM
from llmplug.layers.forward_context import forward_context

if TYPE_CHECKING:
    from llmplug.engine.block_table import BlockTable
    from llmplug.engine.model_runner import BatchInputs, ModelRunner


class EagleProposer:
    """Owns the head, its KV cache and the capture of the target hidden states it reads."""

    def __init__(self, config: EngineConfig, target: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        spec = config.speculative_config
        if not isinstance(target, DecoderForCausalLM) or config.parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                f"speculative_config.method={spec.method!r} needs a decoder target (the generic decoder's families) "
                "on one pipeline stage: its head reads the target's hidden states"
            )
        self.method, self.num_tokens, self.target = spec.method, spec.num_speculative_tokens, target
        rope = target.arch.layers[0].rope
        self.max_position = rope.max_position if rope is not None else 0  # past it: no positions to draft at
        self.head: EagleHead = load_eagle_head(spec.model, spec.method, target.arch.num_layers, self.max_position,
                                               device, dtype)
        self._check_sizes(target)
        self.block_size = config.cache.block_size
        self.max_rows = config.scheduler.max_num_seqs
        self.scratch_per_row = math.ceil(self.num_tokens / self.block_size)
        self.num_blocks = 0
        self.aux: dict[int, torch.Tensor] = {}  # EAGLE-3: target layer -> its input in the last forward [T, hidden]
        if spec.method == "eagle3":
            for i in self.head.config.aux_layer_ids:
                target.model.layers[i].register_forward_pre_hook(self._capturer(i))

    def _check_sizes(self, target: DecoderForCausalLM) -> None:
        head = self.head.config
        if head.target_hidden_size != target.arch.hidden_size or head.arch.vocab_size != target.arch.vocab_size:
            raise ConfigError(
                f"the {self.method} head reads hidden states of {head.target_hidden_size} features over a vocabulary "
                f"of {head.arch.vocab_size}; the target has {target.arch.hidden_size} and {target.arch.vocab_size}: "
                "the head was trained for another model"
            )

    def _capturer(self, layer: int):
        def capture(module: torch.nn.Module, args: tuple) -> None:
            hidden, residual = args[0], args[1]  # the layer's input stream is their sum
            self.aux[layer] = hidden.clone() if residual is None else hidden + residual
        return capture

    # ---- the head's KV cache ------------------------------------------------------------------
    def attention_layers(self) -> list[Attention]:
        """The head's attention layers (counted in the KV cache's block size)."""
        return [m for m in self.head.modules() if isinstance(m, Attention)]

    def allocate_cache(self, num_blocks: int, backend, dtype: torch.dtype, device: torch.device) -> None:
        """The head's cache: the target's `num_blocks`, then the scratch blocks of the draft positions."""
        self.num_blocks = num_blocks
        total = num_blocks + self.max_rows * self.scratch_per_row
        caches = [torch.zeros(backend.layer_kv_cache_shape(layer, total, self.block_size), dtype=dtype, device=device)
                  for layer in self.attention_layers()]
        bind_kv_cache(self.head, caches, backend)

    def _block_tables(self, block_table: BlockTable, req_ids: list[str]) -> np.ndarray:
        """Each request's blocks in the target's table, then its batch row's scratch blocks [len(req_ids), ...]."""
        own, num_own = block_table.gather(req_ids), block_table.lengths(req_ids)
        per_row = self.scratch_per_row
        tables = np.zeros((len(req_ids), own.shape[1] + per_row), dtype=np.int64)
        tables[:, : own.shape[1]] = own
        scratch = self.num_blocks + per_row * np.arange(len(req_ids))[:, None] + np.arange(per_row)
        np.put_along_axis(tables, num_own[:, None] + np.arange(per_row), scratch, axis=1)
        return tables

    # ---- drafting -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, scheduler_output: SchedulerOutput, hidden_states: torch.Tensor, output: ModelRunnerOutput,
                runner: ModelRunner) -> dict[str, list[int]]:
        """Drafts for the next step of every request that sampled in this one (`hidden_states` [T, hidden]:
        the target's output for the step's tokens)."""
        requests, rows = self._kept_positions(scheduler_output, output, runner)
        if not requests:
            return {}
        target_hidden = hidden_states if self.method == "eagle" else torch.cat(
            [self.aux[i] for i in self.head.config.aux_layer_ids], dim=-1)  # [T, 3 * hidden]
        tables = self._block_tables(runner.block_table, [r.req_id for r in requests])
        batch = runner.prepare_inputs(requests, tables)
        index = torch.tensor(rows, device=hidden_states.device)
        out, state = self._run(runner, batch, self.head.reduce(target_hidden[index]))
        drafting_rows = [i for i, r in enumerate(requests) if r.samples]
        if not drafting_rows:
            return {}
        drafting, tables = [requests[i] for i in drafting_rows], tables[drafting_rows]
        tokens = [self._draft_tokens(out[batch.sample_indices])]  # each [S]
        state = state[batch.sample_indices]
        for step in range(1, self.num_tokens):
            positions = [r.num_computed_tokens + len(r.token_ids) + step - 1 for r in drafting]
            if max(positions) >= self.max_position:  # past the rotary table: no further drafts for anyone
                break
            chain = [ScheduledRequest(r.req_id, [0], p, True, None) for r, p in zip(drafting, positions)]
            batch = runner.prepare_inputs(chain, tables)
            batch.input_ids = tokens[-1]  # the drafts stay on the device: no host read per position
            out, state = self._run(runner, batch, state)
            tokens.append(self._draft_tokens(out))
        drafts = torch.stack(tokens, dim=1).tolist()  # [S, k]: one host read
        return {r.req_id: d for r, d in zip(drafting, drafts)}

    def _kept_positions(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput, runner: ModelRunner
                        ) -> tuple[list[ScheduledRequest], list[int]]:
        """The head's share of the step: per request, the positions the target kept with the token after each
        (as a ScheduledRequest), and their rows in the target's hidden states."""
        sampled = dict(zip(output.req_ids, output.sampled_token_ids))
        requests, rows, start = [], [], 0
        for r in scheduler_output.requests:
            q, num_drafts = len(r.token_ids), len(r.spec_token_ids)
            if r.req_id in output.failed or r.pools or (r.samples and r.req_id not in sampled):
                start += q
                continue
            if r.samples:  # the last token and accepted drafts, each followed by the next one it got
                next_ids = r.token_ids[1 : q - num_drafts] + sampled[r.req_id]
            else:  # a prefill chunk: the token after it is the next chunk's first
                state = runner.sampling_state.requests[r.req_id]
                following = (state.prompt_token_ids + state.output_token_ids)[r.num_computed_tokens + q]
                next_ids = r.token_ids[1:] + [following]
            rows.extend(range(start, start + len(next_ids)))
            requests.append(ScheduledRequest(r.req_id, next_ids, r.num_computed_tokens, r.samples, None))
            start += q
        return requests, rows

    def _run(self, runner: ModelRunner, batch: BatchInputs, hidden: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        embedding = self.head.embed_tokens or self.target.model.embed_tokens
        with forward_context(runner.attn_backend.build_metadata(batch.common)):
            return self.head(embedding(batch.input_ids), batch.positions, hidden)

    def _draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's argmax token [N] for each row of `hidden` [N, hidden]."""
        if self.method == "eagle3":
            return self.head.draft_tokens(hidden)
        return self.target.compute_logits(hidden).argmax(dim=-1)  # EAGLE-1 shares the target's lm_head
