"""The recurrent mixers' ops against transformers' own torch references: whole sequences, padded
batches of different lengths, a chunk continued from a carried state, and single decode steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.mamba.modeling_mamba import causal_conv1d_fn, mamba_selective_scan
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from llmplug.layers.recurrent.causal_conv import causal_conv1d_prefill, causal_conv1d_step
from llmplug.layers.recurrent.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step, l2_normalize
from llmplug.layers.recurrent.selective_scan import BLOCK, selective_scan, selective_state_update
from llmplug.layers.recurrent.ssd import ssd_scan, ssd_state_update

torch.manual_seed(0)
LENGTHS = (BLOCK + 13, 5)  # a length past one scan block, and a short one padded to it


def padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """t [1, l, ...] zero-padded to [1, length, ...] along dim 1."""
    return torch.cat([t, t.new_zeros(1, length - t.shape[1], *t.shape[2:])], dim=1)


def test_causal_conv_matches_transformers_in_chunks_padding_and_steps() -> None:
    channels, kernel, n = 6, 4, 23
    x, weight, bias = torch.randn(1, n, channels), torch.randn(channels, kernel), torch.randn(channels)
    expected = causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
    zero = torch.zeros(1, channels, kernel - 1)
    # two chunks, the second padded past its end, the window carried between them
    first, window = causal_conv1d_prefill(x[:, :10], torch.tensor([10]), zero, weight, bias, F.silu)
    second, window = causal_conv1d_prefill(padded(x[:, 10:20], 15), torch.tensor([10]), window, weight, bias, F.silu)
    torch.testing.assert_close(torch.cat([first, second[:, :10]], 1), expected[:, :20])
    steps = []
    for t in range(20, n):
        out, window = causal_conv1d_step(x[:, t], window, weight, bias, F.silu)
        steps.append(out)
    torch.testing.assert_close(torch.stack(steps, 1), expected[:, 20:])


def _mamba_inputs(n: int, d: int = 8, s: int = 4) -> tuple[torch.Tensor, ...]:
    x, dt = torch.randn(1, n, d), F.softplus(torch.randn(1, n, d))
    return x, dt, -torch.rand(d, s) * 2, torch.randn(1, n, s), torch.randn(1, n, s)


def test_selective_scan_matches_transformers_token_loop_over_padded_requests_and_steps() -> None:
    inputs = [_mamba_inputs(n) for n in LENGTHS]
    A = inputs[0][2]
    ref = []
    for x, dt, _, B, C in inputs:
        y, h = mamba_selective_scan(x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
                                    return_last_state=True)
        ref.append((y.transpose(1, 2), h))
    length = max(LENGTHS)
    batch = [torch.cat([padded(t[i], length) for t in inputs]) for i in (0, 1, 3, 4)]  # x, dt (0 at padding), B, C
    y, h = selective_scan(batch[0], batch[1], A, batch[2], batch[3], torch.zeros(2, 8, 4))
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(y[i, :n], ref[i][0][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(h[i], ref[i][1][0], rtol=1e-4, atol=1e-5)
    # a chunk continued from the carried state, then a decode step, equal the whole sequence
    x, dt, _, B, C = inputs[0]
    y1, h1 = selective_scan(x[:, :30], dt[:, :30], A, B[:, :30], C[:, :30], torch.zeros(1, 8, 4))
    y2, h2 = selective_scan(x[:, 30:-1], dt[:, 30:-1], A, B[:, 30:-1], C[:, 30:-1], h1)
    y3, h3 = selective_state_update(x[:, -1], dt[:, -1], A, B[:, -1], C[:, -1], h2)
    torch.testing.assert_close(torch.cat([y1, y2, y3[:, None]], 1), ref[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h3, ref[0][1], rtol=1e-4, atol=1e-5)


def _ssd_inputs(n: int, heads: int = 4, p: int = 3, groups: int = 2, s: int = 5) -> tuple[torch.Tensor, ...]:
    return (torch.randn(1, n, heads, p), F.softplus(torch.randn(1, n, heads)), -torch.rand(heads) * 2,
            torch.randn(1, n, groups, s), torch.randn(1, n, groups, s))


def test_ssd_matches_transformers_chunk_scan_over_padded_requests_initial_states_and_steps() -> None:
    inputs = [_ssd_inputs(n) for n in LENGTHS]
    A = inputs[0][2]
    init = torch.randn(2, 4, 3, 5)
    ref = [mamba2_chunk_scan(x, dt, A, B, C, chunk_size=16, initial_states=init[i : i + 1], return_final_states=True)
           for i, (x, dt, _, B, C) in enumerate(inputs)]
    length = max(LENGTHS)
    batch = [torch.cat([padded(t[i], length) for t in inputs]) for i in (0, 1, 3, 4)]
    y, h = ssd_scan(batch[0], batch[1], A, batch[2], batch[3], init, chunk_size=8)
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(y[i, :n], ref[i][0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h[i], ref[i][1][0], rtol=1e-4, atol=1e-4)
    x, dt, _, B, C = inputs[0]
    y1, h1 = ssd_scan(x[:, :-1], dt[:, :-1], A, B[:, :-1], C[:, :-1], init[:1], chunk_size=32)
    y2, h2 = ssd_state_update(x[:, -1], dt[:, -1], A, B[:, -1], C[:, -1], h1)
    torch.testing.assert_close(torch.cat([y1, y2[:, None]], 1), ref[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h2, ref[0][1], rtol=1e-4, atol=1e-4)


def _gdn_inputs(n: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6) -> tuple[torch.Tensor, ...]:
    q, k = l2_normalize(torch.randn(1, n, hk, dk)), l2_normalize(torch.randn(1, n, hk, dk))
    g = -F.softplus(torch.randn(1, n, hv))
    return q, k, torch.randn(1, n, hv, dv), g, torch.rand(1, n, hv)


def test_gated_delta_rule_matches_transformers_token_loop_over_padded_requests_and_steps() -> None:
    inputs = [_gdn_inputs(n) for n in LENGTHS]
    init = torch.randn(2, 4, 8, 6)
    ref = [torch_recurrent_gated_delta_rule(*t, initial_state=init[i : i + 1], output_final_state=True)
           for i, t in enumerate(inputs)]
    length = max(LENGTHS)
    batch = [torch.cat([padded(t[i], length) for t in inputs]) for i in range(5)]  # g and beta are 0 at padding
    out, h = chunk_gated_delta_rule(*batch, init, scale=8**-0.5)
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(out[i, :n], ref[i][0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h[i], ref[i][1][0], rtol=1e-4, atol=1e-4)
    q, k, v, g, beta = inputs[0]
    o1, h1 = chunk_gated_delta_rule(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], init[:1], 8**-0.5)
    o2, h2 = gated_delta_rule_step(q[:, -1], k[:, -1], v[:, -1], g[:, -1], beta[:, -1], h1, 8**-0.5)
    torch.testing.assert_close(torch.cat([o1, o2[:, None]], 1), ref[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h2, ref[0][1], rtol=1e-4, atol=1e-4)
