"""KV connectors (engine/kv_transfer.py, plugins/kv_connectors): the in-tree offload tiers pass the conformance kit,
an evicted prefix is reloaded rather than recomputed, the disk tier outlives the engine, and a corrupt block file, a
full disk or a bad directory never changes a token."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ConfigError
from llmplug.engine.kv_cache import hash_block
from llmplug.engine.kv_transfer import invalidated_blocks
from llmplug.engine.scheduler_output import ScheduledRequest
from llmplug.plugins.kv_connectors.offload import BlockIndex
from llmplug.plugins.kv_connectors.stores import DiskBlockStore
from llmplug.testing.kv_connectors import check_kv_connector
from tests.models.tiny_models import make_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


def make_llm(tiny, kv_transfer_config: dict | None = None, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": BLOCK, **kwargs}
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return LLM(str(tiny.path), **kwargs)


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def generate(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]


def connector_of(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.kv_connector


# ---- the conformance kit --------------------------------------------------------------------------------------


def test_cpu_tier_passes_the_conformance_kit(tiny_llama):
    report = check_kv_connector(tiny_llama.path, {"kv_connector": "cpu_offload", "kv_offloading_size": 0.01})
    assert report.round_trip_cached_tokens == 32 and report.partial_cached_tokens == 12
    assert report.failed_loads == 8


def test_disk_tier_passes_the_conformance_kit_across_a_restart(tiny_llama, tmp_path):
    config = {"kv_connector": "disk_offload", "kv_offloading_path": str(tmp_path / "kv")}
    report = check_kv_connector(tiny_llama.path, config, restart=True)
    assert report.restart_cached_tokens == 32 and report.failed_loads == 8


# ---- the tiers in the engine ----------------------------------------------------------------------------------


def test_an_evicted_long_prefix_is_reloaded_from_the_cpu_tier_with_the_same_tokens(tiny_llama):
    long, *others = prompts(0, (38, 30, 30, 30))
    # 14 blocks: the other prompts' blocks evict the long prompt's from the paged cache
    llm = make_llm(tiny_llama, {"kv_connector": "cpu_offload", "kv_offloading_size": 0.01},
                   num_gpu_blocks_override=14)
    got = [generate(llm, [p])[0] for p in [long, *others, long]]
    assert got[-1] == (got[0][0], 36)  # the same tokens, from all 9 full blocks but the last token's, loaded
    stats = connector_of(llm).stats
    assert stats.matched_blocks == stats.loaded_blocks == 9  # none was left in the paged cache
    assert stats.failed_loads == 0 and stats.saved_blocks == 9 + 3 * 8 + 1


def test_a_batch_sharing_prefixes_with_chunked_prefill_keeps_its_tokens(tiny_llama):
    shared = prompts(1, (17,))[0]
    batch = [shared + tail for tail in prompts(2, (3, 9, 14))] + prompts(3, (21,))
    llm = make_llm(tiny_llama, {"kv_connector": "cpu_offload"}, max_num_batched_tokens=10)
    first = generate(llm, batch)
    llm.reset_prefix_cache()  # the second round finds its blocks only through the connector
    second = generate(llm, batch)
    assert [tokens for tokens, _ in second] == [tokens for tokens, _ in first]
    assert [cached for _, cached in second] == [16, 24, 28, 20]  # every full block but the last token's


def test_a_corrupted_block_file_is_recomputed_with_the_same_tokens_and_rewritten(tiny_llama, tmp_path):
    config = {"kv_connector": "disk_offload", "kv_offloading_path": str(tmp_path / "kv")}
    long = prompts(4, (27,))[0]
    llm = make_llm(tiny_llama, config)
    [(expected, _)] = generate(llm, [long])
    llm.shutdown()
    assert len(list(tmp_path.glob("kv/*/*.kv"))) == 8  # every block of the 32 computed positions
    parent = None
    for i in range(4):  # the fourth block of the prompt names its file
        parent = hash_block(parent, tuple(long[i * BLOCK : (i + 1) * BLOCK]))
    [victim] = tmp_path.glob(f"kv/*/{parent:032x}.kv")
    corrupt = bytearray(victim.read_bytes())
    corrupt[-5] ^= 0x40  # one bit of one value
    victim.write_bytes(corrupt)
    llm = make_llm(tiny_llama, config)
    [(tokens, cached)] = generate(llm, [long])
    assert tokens == expected
    assert cached == 3 * BLOCK  # the blocks before the corrupt one, loaded in the failed step, still hit
    assert connector_of(llm).stats.failed_loads == 1
    llm.shutdown()
    assert victim.read_bytes() != corrupt  # evicted, then written again from the recomputed block


def test_new_weights_make_the_disk_tier_forget_its_blocks_and_stop(tiny_llama, tmp_path):
    long = prompts(5, (27,))[0]
    llm = make_llm(tiny_llama, {"kv_connector": "disk_offload", "kv_offloading_path": str(tmp_path)})
    generate(llm, [long])
    llm.update_weights(tiny_llama.hf_model.state_dict().items())  # as if new: only the bookkeeping matters
    llm.reset_prefix_cache()
    assert generate(llm, [long])[0][1] == 0  # no block of the old weights is loaded
    llm.shutdown()
    assert not list(tmp_path.glob("*/*.kv"))  # its blocks deleted, and none of the new weights saved


# ---- configuration errors -------------------------------------------------------------------------------------


def test_an_unwritable_disk_tier_directory_is_a_config_error_at_start(tiny_llama, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ConfigError, match="kv_offloading_path=.*cannot write block files"):
        make_llm(tiny_llama, {"kv_connector": "disk_offload", "kv_offloading_path": str(not_a_dir / "kv")})


def test_the_disk_tier_without_a_path_and_a_connector_without_prefix_caching_are_config_errors(tiny_llama):
    with pytest.raises(ConfigError, match="needs kv_transfer_config.kv_offloading_path"):
        make_llm(tiny_llama, {"kv_connector": "disk_offload"})
    with pytest.raises(ConfigError, match="needs cache.enable_prefix_caching"):
        make_llm(tiny_llama, {"kv_connector": "cpu_offload"}, enable_prefix_caching=False)


def test_llmplug_config_shows_the_kv_transfer_flags(capsys):
    from llmplug.entrypoints.cli import main

    assert main(["config", "--kv-connector", "disk_offload", "--kv-offloading-path", "/tmp/blocks",
                 "--kv-offloading-size", "2", "--format", "json"]) == 0
    section = json.loads(capsys.readouterr().out)["config"]["kv_transfer_config"]
    assert section["kv_connector"] == "disk_offload" and section["kv_offloading_path"] == "/tmp/blocks"
    assert section["kv_offloading_size"] == 2.0 and section["kv_role"] == "kv_both"


# ---- the parts ------------------------------------------------------------------------------------------------


def test_a_full_disk_skips_the_write_and_reports_the_block_unsaved(tmp_path, monkeypatch):
    store = DiskBlockStore.open(str(tmp_path), "fp", "test")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: SimpleNamespace(total=100, used=100, free=0))
    store.put(7, torch.arange(16, dtype=torch.uint8))
    store.close()
    assert store.take_failed() == {7}
    assert store.get(7) is None and not list((tmp_path / "fp").glob("*.kv"))


def test_block_files_are_checked_on_read_and_written_atomically(tmp_path):
    store = DiskBlockStore.open(str(tmp_path), "fp", "test")
    row = torch.arange(64, dtype=torch.uint8)
    store.put(5, row)
    store.close()
    reopened = DiskBlockStore.open(str(tmp_path), "fp", "test")
    assert torch.equal(reopened.get(5), row)
    assert [h for h, _ in reopened.listing()] == [5]
    assert not [p for p in (tmp_path / "fp").iterdir() if p.name.endswith(".tmp")]
    [path] = (tmp_path / "fp").glob("*.kv")
    path.write_bytes(path.read_bytes()[:-1])  # a torn write
    assert reopened.get(5) is None
    reopened.close()


def test_the_block_index_evicts_the_least_recently_used_hash():
    index = BlockIndex(capacity=2)
    assert index.add(1) == [] and index.add(2) == []
    index.touch(1)
    assert index.add(3) == [2]
    assert index.num_matched([1, 3, 2]) == 2 and index.num_matched([2, 1]) == 0


def test_a_request_that_hit_a_block_computed_from_a_failed_load_is_invalidated_too():
    def scheduled(req_id, computed, n):
        return ScheduledRequest(req_id, [0] * n, computed, samples=True, new=None)

    # a loaded blocks 0-1 (1 failed) and computes 2; b hit a's blocks 0-2 and computes 3; c is unrelated
    steps = [scheduled("a", 8, 3), scheduled("b", 12, 2), scheduled("c", 0, 4)]
    tables = {"a": [10, 11, 12], "b": [10, 11, 12, 13], "c": [20]}
    requests, bad = invalidated_blocks(steps, tables, BLOCK, {11})
    assert requests == {"a", "b"} and bad == {11, 12, 13}


def test_a_decode_engine_loads_the_prompt_blocks_a_prefill_engine_wrote_to_a_shared_directory(tiny_llama, tmp_path):
    shared = {"kv_connector": "disk_offload", "kv_offloading_path": str(tmp_path)}
    batch = prompts(6, (23, 14))
    prefill = make_llm(tiny_llama, {**shared, "kv_role": "kv_producer"})
    decode = make_llm(tiny_llama, {**shared, "kv_role": "kv_consumer"})  # started before any block was written
    expected = generate(prefill, batch)  # the producer computes (it loads nothing) and writes as it goes
    files = sorted(tmp_path.glob("*/*.kv"))
    got = generate(decode, batch)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert [cached for _, cached in got] == [20, 12]  # every full prompt block but the last token's, loaded
    decode.shutdown()
    prefill.shutdown()
    assert sorted(tmp_path.glob("*/*.kv")) == files  # the consumer wrote and deleted nothing
