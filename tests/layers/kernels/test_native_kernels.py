"""llmplug's CPU kernels (llmplug/layers/kernels/native) against torch's own ops and an attention computed in
float64 from scratch, and the property they exist for: a row's bits never depend on the other rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmplug.layers.activation import SiluAndMul
from llmplug.layers.kernels.amx_linear import amx_linear_enabled
from llmplug.layers.kernels.native import KERNELS_ENV, native_available, ops, use_native
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.rotary import get_rope

pytestmark = pytest.mark.skipif(not native_available(), reason="llmplug's CPU kernels cannot be built here")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_torch(dtype: torch.dtype) -> None:
    """Within a few units in the last place of torch's F.rms_norm (the sum of squares adds in another order)."""
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(9, 576, generator=gen).to(dtype), torch.randn(9, 576, generator=gen).to(dtype)
    weight = (torch.rand(576, generator=gen) + 0.5).to(dtype)
    ulp = 4 * torch.finfo(dtype).eps  # float32: the sum's order moves the last bits
    torch.testing.assert_close(ops().rms_norm(x, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5), rtol=ulp, atol=ulp)
    stream = x.clone()
    out = ops().fused_add_rms_norm(stream, residual, weight, 1e-5)
    assert torch.equal(stream, x + residual)  # the sum, rounded as torch's add rounds, is written into x
    torch.testing.assert_close(out, F.rms_norm(x + residual, (576,), weight, 1e-5), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    x = torch.randn(5, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = F.silu(x[:, :1536]) * x[:, 1536:]
    if dtype == torch.float32:  # a vectorized expf of its own: within an ulp or two
        torch.testing.assert_close(ops().silu_and_mul(x), expected, rtol=1e-6, atol=1e-6)
    else:  # rounded to 16 bits, the two agree exactly
        assert torch.equal(ops().silu_and_mul(x), expected)



def test_bf16_silu_and_mul_gives_torchs_bits_for_every_gate() -> None:
    """Every finite bf16 gate (16 a row: the AVX-512 path's lanes, where it runs) against torch's silu and product."""
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates[torch.isfinite(gates.float())][: 65280]
    for up in (1.0, -3.5, 2.0**-7, 117.0):
        ups = torch.full_like(gates, up)
        got = ops().silu_and_mul(torch.cat([gates.view(-1, 16), ups.view(-1, 16)], 1)).view(-1)
        expected = F.silu(gates) * ups
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), f"up = {up}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN for NaN (the kernels' NaN is c10's 0x7FC0; torch's vectorized conversion keeps payloads)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(
        a.nan_to_num(0.0).view(torch.int16), b.nan_to_num(0.0).view(torch.int16))


def test_bf16_rounding_gives_torchs_bits_for_normal_denormal_nan_and_overflowing_lanes() -> None:
    """The kernels' float32 -> bf16 rounding (bf16.h: vcvtneps2bf16 where a vector has no denormal or NaN lane, the
    integer rounding where it has) against torch's, through the sum fused_add_rms_norm writes back. Rows of 64: some
    16-lane vectors all normal, others holding a denormal, a NaN or an overflow, in every lane position."""
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randint(-32768, 32768, (64, 64), generator=gen, dtype=torch.int32).to(torch.int16)
            .view(torch.bfloat16) for _ in range(2))  # random bit patterns: every exponent, ties included
    tiny, nan = torch.tensor(2.0**-130, dtype=torch.bfloat16), torch.tensor(float("nan"), dtype=torch.bfloat16)
    for row in range(0, 64, 4):
        lane = row // 4  # one special lane in one vector of the row, the row's others normal
        x[row, lane], r[row, lane] = tiny, tiny / 2  # a denormal sum
        x[row + 1, 16 + lane], r[row + 1, 16 + lane] = nan, 1.0
        x[row + 2, 32 + lane], r[row + 2, 32 + lane] = float("inf"), float("-inf")  # their sum: NaN
        big = torch.finfo(torch.bfloat16).max
        x[row + 3, 48 + lane], r[row + 3, 48 + lane] = big, big  # rounds past the largest: infinity
    expected = (x.float() + r.float()).bfloat16()
    stream = x.clone()
    ops().fused_add_rms_norm(stream, r, torch.ones(64, dtype=torch.bfloat16), 1e-5)
    assert same_bits(stream, expected) and stream.isnan().sum() >= 16 and stream.isinf().sum() >= 16
    assert stream.view(torch.int16)[stream.isnan()].eq(0x7FC0).all()
    assert stream[0, 0] != 0 and stream[0, 0].abs() < torch.finfo(torch.bfloat16).tiny  # the denormal was kept
    ops().fused_add_rms_norm(stream, r, torch.ones(64, dtype=torch.bfloat16), 1e-5)  # the next call still works
    assert same_bits(stream, (expected.float() + r.float()).bfloat16())


def test_layers_take_the_kernels_on_cpu_tensors_and_the_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert use_native(x)
    norm, residual = RMSNorm(64).to(torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    native_out, native_sum = norm(x.clone(), residual)
    native_act = SiluAndMul()(x)
    monkeypatch.setenv(KERNELS_ENV, "0")
    assert not use_native(x)
    torch_out, torch_sum = norm(x.clone(), residual)
    assert torch.equal(native_out, torch_out) and torch.equal(native_sum, torch_sum)
    assert torch.equal(native_act, SiluAndMul()(x))


class PagedCase:
    """Random requests in a shuffled paged cache [2, Hkv, num_blocks, block_size, D] and what the kernel reads."""

    def __init__(self, seq_lens: list[int], heads: int = 6, kv_heads: int = 2, dim: int = 64, block_size: int = 4,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dim, self.block_size = heads, kv_heads, dim, block_size
        blocks_each = [-(-n // block_size) for n in seq_lens]
        order = torch.randperm(sum(blocks_each) + 3, generator=gen).tolist()  # non-contiguous tables on purpose
        self.tables, self.seq_lens = [], seq_lens
        for count in blocks_each:
            self.tables.append(order[:count])
            order = order[count:]
        num_blocks = sum(blocks_each) + 3
        self.cache = (torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=gen) * 2).to(dtype)
        self.queries = {r: torch.randn(n, heads, dim, generator=gen).to(dtype) for r, n in enumerate(seq_lens)}

    def run(self, reqs: list[int], q_lens: list[int], window: int = 0, chunk: int = 0, scale: float = 0.125,
            prompt_lens: dict[int, int] | None = None):
        """Attention of the last q_lens[i] tokens of each request reqs[i], in one call -> {req: [q_len, H * D]};
        `prompt_lens` (request -> prompt length) passes each request's prompt length to the kernel."""
        width = max(len(self.tables[r]) for r in reqs)
        tables = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in reqs])
        q = torch.cat([self.queries[r][-n:] for r, n in zip(reqs, q_lens)])
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
        lens = torch.tensor([self.seq_lens[r] for r in reqs])
        prompts = None if prompt_lens is None else torch.tensor([prompt_lens[r] for r in reqs])
        out = ops().paged_attention(q, self.cache[0], self.cache[1], tables, starts, lens, scale, window, chunk,
                                    prompts)
        return {r: out[starts[i] : starts[i + 1]] for i, r in enumerate(reqs)}

    def reference(self, r: int, window: int = 0, chunk: int = 0, scale: float = 0.125) -> torch.Tensor:
        """Every token of request r, in float64 from contiguous keys and an explicit mask -> [n, H * D]."""
        n, group = self.seq_lens[r], self.heads // self.kv_heads
        bs = self.block_size
        slots = torch.tensor([self.tables[r][j // bs] * bs + j % bs for j in range(n)])
        keys, values = (self.cache[p].reshape(self.kv_heads, -1, self.dim)[:, slots].double() for p in (0, 1))
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # [H, n, D]
        scores = torch.einsum("ihd,hjd->hij", self.queries[r].double(), keys) * scale
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = j <= i
        if window:
            seen &= j > i - window
        if chunk:
            seen &= j >= i // chunk * chunk
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        return torch.einsum("hij,hjd->ihd", probs, values).reshape(n, -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("window", "chunk"), [(0, 0), (5, 0), (0, 8), (7, 8)], ids=["full", "window", "chunk", "both"])
def test_paged_attention_matches_a_float64_reference(dtype: torch.dtype, window: int, chunk: int) -> None:
    case = PagedCase([1, 7, 23, 40], dtype=dtype)
    got = case.run([0, 1, 2, 3], [1, 7, 23, 40], window, chunk)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    for r in range(4):
        torch.testing.assert_close(got[r].double(), case.reference(r, window, chunk), rtol=tolerance, atol=tolerance)


def test_values_inside_the_keys_read_their_leading_dims() -> None:
    case = PagedCase([9, 14], kv_heads=1, heads=4, dtype=torch.float32)
    case.cache[1] = case.cache[0]  # a latent layer's one plane: its values are the keys' first dims
    expected = {r: case.reference(r).view(case.seq_lens[r], 4, 64)[..., :48] for r in range(2)}
    tables = torch.tensor([case.tables[0] + [0] * (len(case.tables[1]) - len(case.tables[0])), case.tables[1]])
    q = torch.cat([case.queries[0], case.queries[1]])
    out = ops().paged_attention(
        q, case.cache[0], case.cache[0][..., :48], tables, torch.tensor([0, 9, 23]), torch.tensor([9, 14]), 0.125, 0, 0
    )
    torch.testing.assert_close(out[:9].view(9, 4, 48).double(), expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[9:].view(14, 4, 48).double(), expected[1], rtol=1e-5, atol=1e-5)


# (query heads, KV heads, head dim): unrolled dims 64 and 128 (value sums in registers, 4 or 2 query heads at a
# time, plus the rest), a dim of whole vectors read at run time (80), and one that is not (72)
HEAD_SHAPES = [(6, 2, 64), (10, 2, 128), (5, 1, 80), (4, 2, 72)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), HEAD_SHAPES[1:], ids=["d128", "d80", "d72"])
def test_paged_attention_of_other_head_shapes_matches_a_float64_reference(heads: int, kv_heads: int, dim: int) -> None:
    case = PagedCase([3, 29], heads=heads, kv_heads=kv_heads, dim=dim, dtype=torch.float32)
    got = case.run([0, 1], [3, 29], 6, 0)
    for r in range(2):
        torch.testing.assert_close(got[r].double(), case.reference(r, 6, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), HEAD_SHAPES, ids=["d64", "d128", "d80", "d72"])
@pytest.mark.parametrize(("window", "chunk"), [(0, 0), (7, 8)], ids=["full", "window+chunk"])
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_chunking(
    threads: int, heads: int, kv_heads: int, dim: int, window: int, chunk: int
) -> None:
    """Request 2's tokens: a whole prompt alone, in a batch beside decodes and other prompts, as a chunk after its
    cached context, and as one decode row each; bit for bit the same. A prompt's rows are attended in tiles of
    several rows sharing their key reads, so the chunks below start and end inside other tiles."""
    case = PagedCase([5, 31, 64, 12], heads=heads, kv_heads=kv_heads, dim=dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = case.run([2], [64], window, chunk)[2]
        batched = case.run([0, 1, 2, 3], [1, 31, 64, 1], window, chunk)[2]
        assert torch.equal(alone, batched)
        for q_len in (1, 3, 17):  # the request's last q_len tokens as a later chunk (or a decode), beside others
            tail = case.run([1, 2, 3], [2, q_len, 12], window, chunk)[2]
            assert torch.equal(tail, alone[-q_len:])
    finally:
        torch.set_num_threads(before)


# Prompt rows (positions before their request's prompt length) of a bf16 layer with 64 or 128 dims, blocks of 16
# tokens and plain causal attention take the AMX prompt kernel where AMX is on (prompt_attention.cpp); elsewhere,
# and for generated rows, the float32 rows above. PROMPT_SHAPES: (query heads, KV heads, dim).
PROMPT_SHAPES = [(6, 2, 64), (8, 2, 128)]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), PROMPT_SHAPES, ids=["d64", "d128"])
def test_prompt_rows_match_a_float64_reference(heads: int, kv_heads: int, dim: int) -> None:
    lens = [1, 15, 16, 17, 40, 77]
    case = PagedCase(lens, heads=heads, kv_heads=kv_heads, dim=dim, block_size=16)
    reqs = list(range(len(lens)))
    got = case.run(reqs, lens, scale=dim**-0.5, prompt_lens=dict(enumerate(lens)))
    rows = case.run(reqs, lens, scale=dim**-0.5)  # the float32 rows
    for r in reqs:  # probabilities rounded to bf16 (as an eager bf16 attention rounds them): a bf16 tolerance
        torch.testing.assert_close(got[r].double(), case.reference(r, scale=dim**-0.5), rtol=3e-2, atol=3e-2)
    if amx_linear_enabled():  # the prompt kernel ran: its probabilities are rounded, the float32 rows' are not
        assert any(not torch.equal(got[r], rows[r]) for r in reqs)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), PROMPT_SHAPES, ids=["d64", "d128"])
def test_a_prompt_rows_bits_do_not_depend_on_the_batch_or_the_chunking(
    threads: int, heads: int, kv_heads: int, dim: int
) -> None:
    """Request 2's prompt: whole and alone, in a batch beside decodes and other prompts, and as later chunks that
    start and end inside the kernel's tiles (32 rows, 16 at a time; down to one row); bit for bit the same."""
    case = PagedCase([5, 31, 70, 12], heads=heads, kv_heads=kv_heads, dim=dim, block_size=16)
    prompts = {0: 4, 1: 31, 2: 70, 3: 11}  # requests 0 and 3 decode their first generated token
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = case.run([2], [70], prompt_lens=prompts)[2]
        batched = case.run([0, 1, 2, 3], [1, 31, 70, 1], prompt_lens=prompts)[2]
        assert torch.equal(alone, batched)
        for q_len in (1, 3, 16, 17, 33, 54):
            tail = case.run([1, 2, 3], [2, q_len, 1], prompt_lens=prompts)[2]
            assert torch.equal(tail, alone[-q_len:]), q_len
    finally:
        torch.set_num_threads(before)


def test_generated_rows_and_windowed_layers_keep_the_float32_rows() -> None:
    """A request whose prompt is its first 20 tokens: its later rows are the float32 rows' bits, its prompt rows the
    whole-prompt call's, in one call; a sliding window keeps the float32 rows for every row."""
    case = PagedCase([45], block_size=16)
    everything = case.run([0], [45], prompt_lens={0: 45})[0]
    rows = case.run([0], [45])[0]
    mixed = case.run([0], [45], prompt_lens={0: 20})[0]
    assert torch.equal(mixed[:20], everything[:20]) and torch.equal(mixed[20:], rows[20:])
    assert torch.equal(case.run([0], [45], window=9, prompt_lens={0: 45})[0], case.run([0], [45], window=9)[0])


def test_bad_prompt_lens_are_refused_by_name() -> None:
    case = PagedCase([6, 9], block_size=16)
    with pytest.raises(RuntimeError, match="prompt_lens must be int64"):
        ops().paged_attention(case.queries[0], case.cache[0], case.cache[1], torch.tensor([case.tables[0]]),
                              torch.tensor([0, 6]), torch.tensor([6]), 0.125, 0, 0, torch.tensor([6, 9]))
    assert torch.equal(case.run([0], [6], prompt_lens={0: 6})[0], case.run([0], [6], prompt_lens={0: 6})[0])


def test_bad_metadata_is_refused_by_name() -> None:
    case = PagedCase([6])
    q, keys, values, tables = case.queries[0], case.cache[0], case.cache[1], torch.tensor([case.tables[0]])
    with pytest.raises(RuntimeError, match="query_start_loc ends at"):
        ops().paged_attention(q, keys, values, tables, torch.tensor([0, 5]), torch.tensor([6]), 1.0, 0, 0)
    with pytest.raises(RuntimeError, match="blocks of"):  # more keys than the table's blocks hold
        ops().paged_attention(q, keys, values, tables, torch.tensor([0, 6]), torch.tensor([99]), 1.0, 0, 0)


def test_cache_and_attend_is_the_cache_write_then_attention() -> None:
    """The fused call from a fused qkv row: the same cache and the same bits as the two kernels; a q, k or v whose
    width does not fit the cache is refused by name."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 6, 2, 64, 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    q, k, v = qkv[:, : heads * dim], qkv[:, heads * dim : (heads + kv_heads) * dim], qkv[:, (heads + kv_heads) * dim :]
    cache = torch.randn(2, kv_heads, 5, 4, dim, generator=gen).to(torch.bfloat16)
    tables, starts, lens = torch.tensor([[3, 0, 4, 1]]), torch.tensor([0, tokens]), torch.tensor([tokens + 6])
    slots = torch.tensor([tables[0, p // 4] * 4 + p % 4 for p in range(6, 6 + tokens)])
    fused_cache, split_cache = cache.clone(), cache.clone()
    fused = ops().cache_and_attend(q, k, v, fused_cache, slots, tables, starts, lens, 0.125, 0, 0)
    ops().reshape_and_cache(k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim), split_cache[0],
                            split_cache[1], slots)
    split = ops().paged_attention(q.view(tokens, heads, dim), split_cache[0], split_cache[1], tables, starts, lens,
                                  0.125, 0, 0)
    assert torch.equal(fused_cache, split_cache) and not torch.equal(fused_cache, cache)
    assert torch.equal(fused, split)
    with pytest.raises(RuntimeError, match="cache_and_attend: q \\[T, H \\* D\\], k and v \\[T, Hkv \\* D\\] expected"):
        ops().cache_and_attend(q, k[:, :-1], v, fused_cache, slots, tables, starts, lens, 0.125, 0, 0)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rotary_gives_the_torch_paths_bits(monkeypatch: pytest.MonkeyPatch, neox: bool, rotary_dim: int) -> None:
    rope = get_rope(64, rotary_dim, 512, 10000.0, is_neox_style=neox)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 512, (11,), generator=gen)
    qkv = torch.randn(11, 9 * 64, generator=gen).to(torch.bfloat16)  # q and k heads inside a wider row
    results = []
    for mode in ("auto", "0"):
        monkeypatch.setenv(KERNELS_ENV, mode)
        rows = qkv.clone()
        rope.cos_sin(positions, rows.dtype).apply_(rows[:, : 7 * 64].view(11, 7, 64))
        results.append(rows)
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], qkv)  # it did rotate


@pytest.mark.parametrize(("tokens", "dim"), [(5, 16), (700, 64), (300, 128)])  # 32, 128, 256 bytes a row
def test_reshape_and_cache_stores_each_tokens_heads_at_its_slot(tokens: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(4)
    heads, blocks = 3, tokens // 4 + 2
    kv = torch.randn(tokens, 2 * heads * dim, generator=gen).to(torch.bfloat16)  # k and v side by side (fused qkv)
    k, v = kv[:, : heads * dim].view(tokens, heads, dim), kv[:, heads * dim :].view(tokens, heads, dim)
    cache = torch.zeros(2, heads, blocks, 4, dim, dtype=torch.bfloat16)
    slots = torch.randperm(4 * blocks, generator=gen)[:tokens]
    ops().reshape_and_cache(k, v, cache[0], cache[1], slots)
    flat = cache.view(2, heads, 4 * blocks, dim)
    assert torch.equal(flat[0][:, slots], k.transpose(0, 1)) and torch.equal(flat[1][:, slots], v.transpose(0, 1))
    untouched = torch.ones(4 * blocks, dtype=torch.bool)
    untouched[slots] = False
    assert flat[:, :, untouched].abs().sum() == 0
    bad = slots.clone()
    bad[0] = 4 * blocks
    with pytest.raises(RuntimeError, match=f"slot {4 * blocks} of token 0 is outside the cache's {4 * blocks} slots"):
        ops().reshape_and_cache(k, v, cache[0], cache[1], bad)
    ops().reshape_and_cache(k, v, cache[0], cache[1], slots)  # the next good call works
    assert torch.equal(flat[0][:, slots], k.transpose(0, 1))


def test_the_build_directory_is_the_same_after_building(monkeypatch, tmp_path):
    """torch's cpp_extension appends to the flag lists it is given: the build must hand it copies, or the key of
    build_directory() changes in the process that built (and it names a directory that does not exist)."""
    from llmplug.layers.kernels import native

    calls = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, **kwargs):
        calls.append(name)
        extra_cflags.append("-DADDED_BY_TORCH")
        extra_ldflags.append("-ltorch")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    monkeypatch.setattr(native, "_register_fakes", lambda: None)  # the fake build loads no library
    native._load.cache_clear()
    try:
        before = native.build_directory()
        assert native.native_available() and calls == [native.NAME]
        assert native.build_directory() == before
    finally:
        native._load.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_layout", ["rows", "columns"])
def test_row_bmm_matches_float64_and_a_row_is_the_same_in_any_batch(dtype, b_layout) -> None:
    """llmplug_cpu::row_bmm: a [N, M, K] (a strided view) @ b [N, K, L] with b's rows or its columns contiguous;
    rows carry +-2^19 at two columns with equal weights, so any change of summation order shows."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(16, 3, 100, generator=generator)
    b = torch.randn(3, 100, 72, generator=generator)
    for row in range(16):
        first, last = row % 4, 99 - row % 4
        b[:, last] = b[:, first]
        a[row, :, first], a[row, :, last] = 2.0**19, -(2.0**19)
    a, b = a.to(dtype).transpose(0, 1), b.to(dtype)  # a [3, 16, 100], strided
    if b_layout == "columns":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    full = ops().row_bmm(a, b)
    assert full.dtype == dtype and full.shape == (3, 16, 72)
    expected = torch.bmm(a.double(), b.double())
    # the +-2^19 pairs cancel: float32 sums keep ~2^19 * 2^-24 of absolute error, whatever the order
    rtol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full.double(), expected.to(dtype).double(), rtol=rtol, atol=1.0)
    for rows in range(1, 17):
        assert torch.equal(ops().row_bmm(a[:, :rows], b), full[:, :rows]), f"{rows} rows"
