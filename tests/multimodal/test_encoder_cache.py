"""The scheduler's side of images: the encoder budget per step, the encoder cache's books (who needs an image,
what is evicted), and image hashes in the block hashes."""

from __future__ import annotations

import torch

from llmplug.engine.encoder_cache import EncoderCacheManager
from llmplug.engine.kv_cache import block_extra_keys
from llmplug.engine.multimodal import MultiModalFeature
from llmplug.engine.request import Request
from tests.engine.test_scheduler import EOS, make_scheduler, run_until_done, scheduled, step

IMAGE = 7  # the placeholder token


def feature(name: str, offset: int, length: int = 16) -> MultiModalFeature:
    return MultiModalFeature("image", name, {"pixel_values": torch.zeros(1)}, offset, length)


def image_request(req_id: str, features: list[MultiModalFeature], num_tokens: int = 40) -> Request:
    from llmplug.core.params import SamplingParams

    prompt = [1000 * ord(req_id[0]) + i for i in range(num_tokens)]  # no prefix shared with another request
    for f in features:
        prompt[f.offset : f.end] = [IMAGE] * f.length
    return Request(req_id, prompt, SamplingParams(max_tokens=2), eos_token_ids=(EOS,), mm_features=features)


def test_a_chunk_stops_before_an_image_the_step_encoder_budget_cannot_take():
    sched = make_scheduler(max_num_batched_tokens=128, max_num_encoder_input_tokens=16)
    sched.add_request(image_request("a", [feature("x", 4)]))
    sched.add_request(image_request("b", [feature("y", 10)]))
    out, _ = step(sched)
    assert scheduled(out) == {"a": 40, "b": 10}  # b's image waits for the next step's budget
    out, _ = step(sched)
    assert scheduled(out)["b"] == 30
    run_until_done(sched)


def test_an_image_larger_than_the_budget_is_encoded_alone_and_a_cached_one_costs_nothing():
    sched = make_scheduler(max_num_batched_tokens=128, max_num_encoder_input_tokens=8)
    sched.add_request(image_request("a", [feature("x", 4)]))
    sched.add_request(image_request("b", [feature("x", 20)]))  # the same image: cached by a's step
    out, _ = step(sched)
    assert scheduled(out) == {"a": 40, "b": 40}
    run_until_done(sched)


def test_cache_books_release_on_completion_and_evict_least_recently_used():
    cache = EncoderCacheManager(cache_size=32)
    a, b = image_request("a", [feature("x", 0)]), image_request("b", [feature("y", 0)])
    cache.allocate(a, a.mm_features[0])
    cache.allocate(b, b.mm_features[0])
    c = image_request("c", [feature("z", 0)])
    assert not cache.can_allocate(c.mm_features[0])  # both still needed
    cache.release(a, computed_up_to=16)  # a's placeholders are computed: x stays cached, evictable
    assert cache.has("x") and cache.can_allocate(c.mm_features[0])
    cache.allocate(c, c.mm_features[0])
    assert not cache.has("x") and cache.take_freed() == ["x"] and cache.take_freed() == []
    big = image_request("d", [feature("w", 0, length=64)])
    cache.release(b)
    cache.release(c)
    assert cache.can_allocate(big.mm_features[0])  # larger than the cache, but alone in it


def test_block_hashes_name_the_images_in_the_block():
    x, y = image_request("a", [feature("x", 4)]), image_request("b", [feature("y", 4)])
    assert block_extra_keys(x, 0, 4) == block_extra_keys(y, 0, 4) == ()  # text before the image
    assert block_extra_keys(x, 1, 4) == (("x", 0),) and block_extra_keys(y, 1, 4) == (("y", 0),)
    assert block_extra_keys(x, 2, 4) == (("x", 4),)  # where in the image the block starts
    assert block_extra_keys(x, 5, 4) == ()


def test_an_item_split_into_runs_fills_only_its_masked_tokens_however_chunked():
    """An image whose placeholders are runs with text between them (Idefics3's tile tags): one item over the whole
    span, an is_embed mask, one encoder row per masked token — in order, whatever the chunk boundaries."""
    from llmplug.engine.encoder_cache import EncoderCache

    mask = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    item = MultiModalFeature("image", "x", {"pixel_values": torch.zeros(1)}, 5, len(mask), mask)
    assert (item.num_embeds, item.end) == (6, 14)
    cache = EncoderCache()
    cache.outputs["x"] = torch.arange(6.0)[:, None]  # [num_embeds, hidden]
    for chunk in (1, 2, 3, 4, 20):
        filled = {}
        for start in range(0, 20, chunk):
            for offset, rows in cache.step_rows([item], start, start + chunk):
                filled.update({start + offset + k: int(row) for k, row in enumerate(rows)})
        assert filled == {5: 0, 6: 1, 9: 2, 10: 3, 11: 4, 13: 5}, chunk


def lookups(sched) -> tuple[int, int]:
    return sched.encoder_cache.num_queries, sched.encoder_cache.num_hits


def test_each_image_item_is_one_lookup_and_a_cached_image_is_a_hit():
    sched = make_scheduler(max_num_batched_tokens=128)
    sched.add_request(image_request("a", [feature("x", 4)]))
    run_until_done(sched)
    assert lookups(sched) == (1, 0)  # computed for a
    sched.add_request(image_request("b", [feature("x", 20), feature("y", 2)]))
    run_until_done(sched)
    assert lookups(sched) == (3, 1)  # x held from a's request, y computed


def test_an_image_spread_over_chunks_is_looked_up_once_and_a_repeat_in_one_chunk_hits():
    sched = make_scheduler(max_num_batched_tokens=6)  # 16 placeholders span three chunks at least
    sched.add_request(image_request("a", [feature("x", 4)]))
    run_until_done(sched)
    assert lookups(sched) == (1, 0)
    sched = make_scheduler(max_num_batched_tokens=128)
    sched.add_request(image_request("b", [feature("z", 0), feature("z", 20)]))  # the same picture twice
    run_until_done(sched)
    assert lookups(sched) == (2, 1)  # encoded once for both


def test_the_same_image_twice_is_two_mm_cache_queries_and_one_hit_in_stats_and_metrics(tiny_llava, images):
    from prometheus_client.parser import text_string_to_metric_families

    from llmplug import LLM, SamplingParams
    from llmplug.entrypoints.openai.metrics import ServerMetrics

    llm = LLM(str(tiny_llava.path), dtype="float32", block_size=4, num_gpu_blocks_override=128,
              enable_prefix_caching=False)  # else the second prompt's image blocks come from the prefix cache
    try:
        params = SamplingParams(temperature=0, max_tokens=2)
        for question in ("What is it?", "Which colour?"):  # one after the other: the second finds it cached
            llm.generate({"prompt": f"USER: <image>\n{question} ASSISTANT:",
                          "multi_modal_data": {"image": images["gradient"]}}, params, use_tqdm=False)
        stats = llm.stats()
        assert (stats["mm_cache_queries"], stats["mm_cache_hits"]) == (2, 1)
        text = ServerMetrics(llm.stats, "llava", 256).render().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert (samples["vllm:mm_cache_queries_total"], samples["vllm:mm_cache_hits_total"]) == (2, 1)
    finally:
        llm.shutdown()
