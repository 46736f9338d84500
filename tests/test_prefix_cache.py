"""The embedded engine's prefix cache: a finished request's KV serves the requests that extend it (a multi-turn
episode's next turn), and the whole blocks of a prefix it shares with one it does not extend (another task's
system prompt), with the same tokens and logprobs as a prefill from scratch; a group's identical prompts
are prefilled once, and requests prefilled together compute a prefix they share once; loads and memory
releases empty it, an adapter loaded again or unloaded takes its own entries,
and a request whose KV spans a load or a reload of its adapter is not kept; the bound evicts the least recently used;
``engine.prefix_cache_tokens=0`` turns it off end to end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_request
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import load_config
from rollout_server.__main__ import engine_urls
from rollout_server.engine.kv import KVBatch
from rollout_server.engine.lora import Adapter
from rollout_server.engine.prefix_cache import BLOCK_TOKENS, PrefixCache, shared_prefixes
from rollout_server.engine.request import Request
from rollout_server.engine.scheduler import SHARED_PREFIX_MIN_SAVED, Scheduler
from rollout_server.engine_client import EngineClient

WAIT_S = 60.0
TOOL_ANSWER = [7, 8, 9]  # what a tool turn appends before the next assistant turn


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def scheduler(model: torch.nn.Module, tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Scheduler]:
    tokens = getattr(request, "param", 16384)
    engine = Scheduler(model, AutoTokenizer.from_pretrained(tiny_model_dir), model_path=str(tiny_model_dir),
                       prefix_cache_tokens=tokens)
    engine.start()
    try:
        yield engine
    finally:
        engine.close()


def layers(n: int, value: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, n, 4), value), torch.full((2, n, 4), value)) for _ in range(3)]


def conversations(engine: Scheduler, prompts: list[list[int]], turns: int) -> list[list[Request]]:
    """``turns`` rounds: every conversation is sent, then extended by its output and a tool answer."""
    rounds, convs = [], [list(p) for p in prompts]
    for turn in range(turns):
        reqs = [greedy_request(f"t{turn}-{i}", c) for i, c in enumerate(convs)]
        engine.submit(reqs)
        for r in reqs:
            r.future.result(timeout=WAIT_S)
        rounds.append(reqs)
        convs = [c + r.output_ids + TOOL_ANSWER for c, r in zip(convs, reqs, strict=True)]
    return rounds


def test_lookup_finds_the_longest_entry_under_the_same_adapter_and_the_bound_evicts_the_least_recent() -> None:
    cache = PrefixCache(max_tokens=12)
    cache.insert([1, 2, 3], None, layers(3))
    cache.insert([1, 2, 3, 4, 5], None, layers(5, 1.0))
    assert cache.lookup([1, 2, 3, 4, 5, 9], None).entry.tokens == [1, 2, 3, 4, 5]
    assert cache.lookup([1, 2, 3, 4], None).entry.tokens == [1, 2, 3]
    assert cache.lookup([1, 2, 3, 4], "a") is None and cache.lookup([2, 3], None) is None
    cache.insert([1, 2, 3, 4, 5, 6], "a", layers(6))  # 14 tokens: [1..5], used least recently, leaves
    assert cache.lookup([1, 2, 3, 4, 5, 9], None).entry.tokens == [1, 2, 3]
    assert cache.tokens == 9 and cache.nbytes == sum(k.nbytes + v.nbytes for k, v in layers(9))

    extended = cache.lookup([1, 2, 3, 4, 5, 6, 7], "a")
    assert extended.extends and extended.tokens == 6
    cache.insert([1, 2, 3, 4, 5, 6, 7], "a", layers(7), replaces=extended.entry)  # the longer one takes its place
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8], "a").entry.tokens == [1, 2, 3, 4, 5, 6, 7] and cache.tokens == 10
    kept = layers(3, 3.0)
    cache.insert([4, 4, 4], None, kept)  # 13 tokens: [1, 2, 3] leaves
    cache.insert([4, 4, 4], None, layers(3))  # the same tokens again: kept once
    kept[0][0].zero_()  # the cache holds a copy
    assert cache.lookup([1, 2, 3], None) is None
    assert cache.lookup([4, 4, 4, 4], None).entry.layers[0][0].eq(3.0).all()
    assert len(cache) == 2 and cache.tokens == 10
    cache.insert(list(range(13)), None, layers(13))  # longer than the bound: not kept
    assert cache.lookup(list(range(14)), None) is None and cache.tokens == 10
    cache.clear()
    assert len(cache) == cache.tokens == cache.nbytes == 0
    off = PrefixCache(max_tokens=0)
    off.insert([1], None, layers(1))
    assert len(off) == 0


def test_lookup_takes_the_whole_blocks_a_request_shares_with_an_entry_it_does_not_extend() -> None:
    cache = PrefixCache(max_tokens=30, block=4)
    first = list(range(1, 11))  # another episode's turn: the same first 8 tokens, then its own
    cache.insert(first, None, layers(10))
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 99, 100], None).tokens == 4  # a whole block, not the 7 they share
    hit = cache.lookup([*range(1, 10), 99], None)
    assert (hit.entry.tokens, hit.tokens, hit.extends) == (first, 8, False)
    assert cache.lookup([*range(1, 10), 99], "a") is None and cache.lookup([1, 2, 3, 99], None) is None
    cache.insert([1, 2, 3, 4, 5, 6], None, layers(6))
    assert cache.lookup([1, 2, 3, 4, 5, 6, 50, 51], None).extends  # the one it extends: 6 tokens against 4
    assert cache.lookup([*range(1, 10), 99], None).entry.tokens == first  # 8 shared beat the 6 it extends
    cache.insert(list(range(1, 21)), "a", layers(20))  # 36 tokens: the least recent, [1..6], leaves
    assert len(cache) == 2 and cache.lookup([1, 2, 3, 4, 5, 6, 50, 51], None).entry.tokens == first
    assert cache.lookup([*range(1, 13), 99], "a").tokens == 12
    cache.insert(list(range(40, 61)), None, layers(21))  # 51 tokens: both leave, and their blocks with them
    assert len(cache) == 1 and cache.lookup([*range(1, 10), 99], None) is None
    assert cache.lookup([*range(1, 13), 99], "a") is None and cache.lookup([*range(40, 52), 7], None).tokens == 12
    cache.clear()
    assert cache.lookup([*range(40, 52), 7], None) is None


def test_a_prefill_from_cached_keys_equals_one_from_scratch(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (30, 17, 4, 3)]
    scratch, logits, reused = KVBatch.prefill(model, seqs)
    assert reused == [0, 0, 0, 0]
    first, _, _ = KVBatch.prefill(model, [seqs[0][:25], seqs[1][:12]])
    past = [first.row(0), first.row(1), None, None]
    cached, cached_logits, reused = KVBatch.prefill(model, seqs, past)
    assert reused == [25, 12, 0, 0]  # the forward runs 5 columns: each cached row's rest, the short rows whole
    torch.testing.assert_close(cached_logits, logits, atol=1e-4, rtol=1e-4)
    step = torch.tensor([11, 12, 13, 14])
    torch.testing.assert_close(cached.decode(model, step), scratch.decode(model, step), atol=1e-4, rtol=1e-4)

    longer = [seqs[0], seqs[1][:13]]  # rests of 5 and 1: row 1 runs 4 of its cached tokens again
    _, want, _ = KVBatch.prefill(model, longer)
    _, got, reused = KVBatch.prefill(model, longer, [first.row(0), first.row(1)])
    assert reused == [25, 8]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_merged_and_kept_rows_decode_as_their_own_forwards(model: torch.nn.Module) -> None:
    """Admissions merge into the running batch and finished rows leave it (one copy each, the shorter side
    left-padded with zeros; rows leaving whose places the last rows fill are not copied at all, those rows move in
    place, while the rows kept are at least half those the buffers hold); every row then decodes as a forward over
    its own sequence."""
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (9, 30, 14, 22, 5)]
    batch, _, _ = KVBatch.prefill(model, seqs[:3])
    other, _, _ = KVBatch.prefill(model, seqs[3:])
    batch.merge(other)
    assert batch.mask.shape[1] == 30 and batch.lengths.tolist() == [9, 30, 14, 22, 5]
    assert all(not layer.keys[3, :, :8].any() for layer in batch.cache.layers)  # 22 tokens padded to 30 by zeros
    batch.keep([4, 0, 3])  # the longest left: 8 columns are padding in every row kept
    assert batch.mask.shape[1] == 22 and batch.lengths.tolist() == [5, 9, 22]
    kept = [seqs[4], seqs[0], seqs[3]]

    def decodes_as_alone(steps: list[list[int]]) -> None:
        nonlocal kept
        for step in steps:
            got = batch.decode(model, torch.tensor(step))
            kept = [seq + [t] for seq, t in zip(kept, step, strict=True)]
            with torch.no_grad():
                want = torch.stack([model(input_ids=torch.tensor([seq])).logits[0, -1] for seq in kept])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    decodes_as_alone([[11, 12, 13], [14, 15, 16]])
    batch.merge(KVBatch.prefill(model, [seqs[1][:12]])[0])
    kept.append(seqs[1][:12])
    decodes_as_alone([[17, 18, 19, 20]])
    storages = [layer.keys.untyped_storage().data_ptr() for layer in batch.cache.layers]
    batch.keep([3, 1])  # rows 0 and 2 (the longest) leave, the last row takes row 0's place
    assert [layer.keys.untyped_storage().data_ptr() for layer in batch.cache.layers] == storages  # in place
    assert batch.mask.shape[1] == 13 and batch.lengths.tolist() == [13, 12]
    kept = [kept[3], kept[1]]
    decodes_as_alone([[21, 22], [23, 24]])
    held = batch.nbytes
    batch.keep([1])  # the last row could take row 0's place, but one row kept of the four held: a copy of its size
    assert [layer.keys.untyped_storage().data_ptr() for layer in batch.cache.layers] != storages
    assert batch.nbytes < held / 2 and batch.lengths.tolist() == [14]
    kept = [kept[1]]
    decodes_as_alone([[25], [26]])


@pytest.mark.parametrize("scheduler", [0, 16384], indirect=True, ids=["off", "on"])
def test_multi_turn_conversations_reuse_their_earlier_turns(scheduler: Scheduler, model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (21, 40, 33)]
    rounds = conversations(scheduler, [p for p in prompts for _ in range(2)], turns=3)  # a group of 2 each
    prompt_tokens = scheduler.metrics.prompt_tokens._value.get()
    assert prompt_tokens == sum(len(r.input_ids) for reqs in rounds for r in reqs)
    for reqs in rounds:  # every turn's tokens and logprobs are those of a forward over the whole conversation
        for r in reqs:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([r.input_ids + r.output_ids])).logits[0]
            lp = torch.log_softmax(logits[len(r.input_ids) - 1 : -1], -1)
            assert r.output_ids == lp.argmax(-1).tolist()
            torch.testing.assert_close(torch.tensor(r.logprobs), lp.max(-1).values, atol=1e-4, rtol=1e-4)
    cached = [r.cached_tokens for reqs in rounds[1:] for r in reqs]
    if scheduler.prefix_cache.max_tokens == 0:
        assert cached == [0] * 12 and len(scheduler.prefix_cache) == 0
        assert scheduler.metrics.cached_tokens._value.get() == 0
        assert scheduler.metrics.shared_tokens._value.get() == prompt_tokens // 2  # the second of each pair
        return
    # turn 2 extends turn 1 by its 10 outputs and the tool answer: all but the last output and the answer
    # (4 tokens) come from the cache, and turn 3 likewise
    assert cached == [len(r.input_ids) - 4 for reqs in rounds[1:] for r in reqs]
    # a group's pair is prefilled once; each copy counts as if prefilled alone (the cache's part as cached, the
    # second copy's rest as shared), so the panels' shares of the prompt tokens add up
    assert scheduler.metrics.cached_tokens._value.get() == sum(cached)
    copies = [r for reqs in rounds for r in reqs[1::2]]
    assert scheduler.metrics.shared_tokens._value.get() == sum(len(r.input_ids) - r.cached_tokens for r in copies)
    assert rounds[1][0].reply(scheduler.tokenizer)["meta_info"]["cached_tokens"] == cached[0]
    assert len(scheduler.prefix_cache) == 3  # each conversation's last turn (a pair's once); what they extended left
    assert scheduler.flush_cache() and len(scheduler.prefix_cache) == 0
    assert scheduler._kv_bytes() == 0


def test_later_turns_beside_a_new_prompt_run_only_their_rests(scheduler: Scheduler, model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    first = conversations(scheduler, [torch.randint(5, 200, (n,), generator=gen).tolist() for n in (12, 15, 9)], 1)
    later = [greedy_request(f"later-{i}", r.input_ids + r.output_ids + TOOL_ANSWER) for i, r in enumerate(first[0])]
    new = greedy_request("new", torch.randint(5, 200, (80,), generator=gen).tolist())
    scheduler.call(lambda: scheduler.pause("retract")).result(timeout=WAIT_S)
    scheduler.submit([*later, new])  # admitted together at continue: one chunk
    scheduler.call(scheduler.resume).result(timeout=WAIT_S)
    for r in [*later, new]:
        r.future.result(timeout=WAIT_S)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r.input_ids + r.output_ids])).logits[0]
        assert r.output_ids == logits[len(r.input_ids) - 1 : -1].argmax(-1).tolist()
    # one forward would run the later turns 80 columns wide, taking only their first 4-11 tokens from the cache
    assert [r.cached_tokens for r in later] == [len(r.input_ids) - 4 for r in later] and new.cached_tokens == 0


def two_prompts() -> tuple[list[int], list[int]]:
    """Two tasks' prompts, 45 and 50 tokens, whose first 20 (a system prompt) are the same."""
    system = list(range(100, 120))
    return system + list(range(1, 26)), system + list(range(30, 60))


def test_a_new_task_takes_the_whole_blocks_of_the_system_prompt_another_tasks_turn_left(
    scheduler: Scheduler, model: torch.nn.Module
) -> None:
    """Prefilled apart, a second task's prompt takes from the first task's finished turn the whole blocks of the
    system prompt they share (16 of its 20 tokens), with the tokens and logprobs of a forward from scratch, and
    the first task's entry stays: the second does not extend it."""
    a, b = two_prompts()
    [[first]] = conversations(scheduler, [a], 1)
    [[second]] = conversations(scheduler, [b], 1)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([second.input_ids + second.output_ids])).logits[0]
    lp = torch.log_softmax(logits[len(second.input_ids) - 1 : -1], -1)
    assert second.output_ids == lp.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(second.logprobs), lp.max(-1).values, atol=1e-4, rtol=1e-4)
    assert first.cached_tokens == 0 and second.cached_tokens == BLOCK_TOKENS == 16
    assert scheduler.metrics.cached_tokens._value.get() == BLOCK_TOKENS and len(scheduler.prefix_cache) == 2


def test_shared_prefixes_groups_rows_by_what_they_share_and_skips_what_the_cache_holds() -> None:
    a, b = two_prompts()
    seqs = [(None, a + [200 + i] * 5) for i in range(3)] + [(None, b + [210 + i] * 6) for i in range(2)]
    seqs.append((None, [5] * 40))  # shares nothing
    assert shared_prefixes(seqs, [0] * 6, 16) == [(45, [0, 1, 2]), (50, [3, 4])]
    # the prefixes themselves share the system prompt: computed once too, one level up
    assert shared_prefixes([(None, a), (None, b)], [0, 0], 16) == [(20, [0, 1])]
    # a row whose cached KV covers all but 15 of the prefix gains too little; alone, its sibling has no one to share
    assert shared_prefixes(seqs, [0, 0, 30, 0, 35, 0], 16) == [(45, [0, 1])]
    # another adapter's rows, and rows sharing fewer than min_tokens, share nothing
    assert shared_prefixes([(None, a + [1]), ("x", a + [2])], [0, 0], 16) == []
    assert shared_prefixes([(None, a + [1]), (None, a + [2])], [0, 0], 46) == []
    assert shared_prefixes([(None, a), (None, a + [3])], [0, 0], 16) == [(44, [0, 1])]  # each keeps a token to run


@pytest.mark.parametrize("min_saved", [SHARED_PREFIX_MIN_SAVED, 0])
def test_requests_prefilled_together_compute_what_they_share_once(scheduler: Scheduler, model: torch.nn.Module,
                                                                  min_saved: int) -> None:
    """A swap retracted a group's samples (one prompt, different outputs so far) and another task's: admitted
    together, each prompt runs once, the system prompt the two share once, and every token is what a forward over
    the whole sequence gives. Under ``shared_prefix_min_saved`` tokens saved, nothing runs apart."""
    scheduler.shared_prefix_min_saved = min_saved
    a, b = two_prompts()
    reqs = [greedy_request(f"a{i}", a + [200 + i] * 5) for i in range(3)]
    reqs += [greedy_request(f"b{i}", b + [210 + i] * 6) for i in range(2)] + [greedy_request("lone", [5] * 40)]
    scheduler.call(lambda: scheduler.pause("retract")).result(timeout=WAIT_S)
    scheduler.submit(reqs)  # admitted together at continue: one chunk
    scheduler.call(scheduler.resume).result(timeout=WAIT_S)
    for r in reqs:
        r.future.result(timeout=WAIT_S)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r.input_ids + r.output_ids])).logits[0]
        lp = torch.log_softmax(logits[len(r.input_ids) - 1 : -1], -1)
        assert r.output_ids == lp.argmax(-1).tolist(), r.rid
        torch.testing.assert_close(torch.tensor(r.logprobs), lp.max(-1).values, atol=1e-4, rtol=1e-4)
    assert scheduler.metrics.cached_tokens._value.get() == 0  # none of it came from the cache
    if min_saved > 45 * 2 + 50:
        assert scheduler.metrics.shared_tokens._value.get() == 0 and [r.cached_tokens for r in reqs] == [0] * 6
        return
    assert scheduler.metrics.shared_tokens._value.get() == 45 * 2 + 50 + 20
    # the group's rows run as wide as the other task's rest (6 columns), so one token of their prefix runs again
    assert [r.cached_tokens for r in reqs] == [44] * 3 + [50] * 2 + [0]


def test_loads_and_releases_empty_the_cache_adapters_take_their_own_and_a_request_spanning_a_load_is_not_kept(
    scheduler: Scheduler, model: torch.nn.Module
) -> None:
    def on_engine(fn: Callable[[], object]) -> object:
        return scheduler.call(fn).result(timeout=WAIT_S)

    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    conversations(scheduler, [[5, 6, 7, 8]], turns=1)
    assert len(scheduler.prefix_cache) == 1
    on_engine(lambda: scheduler.load_weights(weights, require_all=True, model_path=None, version="1"))
    assert len(scheduler.prefix_cache) == 0

    def started(req: Request) -> None:
        scheduler.submit([req])
        deadline = time.monotonic() + WAIT_S
        while len(req.output_ids) < 5:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.001)

    spanning = greedy_request("spans", [9, 10, 11], n=300)
    started(spanning)
    on_engine(lambda: scheduler.pause("in_place"))  # it keeps the KV of version 1 across the load
    on_engine(lambda: scheduler.load_weights(weights, require_all=True, model_path=None, version="2"))
    on_engine(scheduler.resume)
    spanning.future.result(timeout=WAIT_S)
    assert len(spanning.output_ids) == 300 and len(scheduler.prefix_cache) == 0

    kept = greedy_request("kept", [9, 10, 11], n=300)  # a load told not to flush keeps what the old weights computed
    started(kept)
    on_engine(lambda: scheduler.pause("in_place"))
    on_engine(lambda: scheduler.load_weights(weights, require_all=True, model_path=None, version="3",
                                             flush_cache=False))
    on_engine(scheduler.resume)
    kept.future.result(timeout=WAIT_S)
    assert len(scheduler.prefix_cache) == 1

    # an adapter loaded again or unloaded takes only its own KV: the base model's stays
    on_engine(lambda: scheduler.install_adapter("a", Adapter("a", "0", 1.0, {})))
    base = [5, 6, 7, 8]
    conversations(scheduler, [base], turns=1)
    for change in (lambda: scheduler.install_adapter("a", Adapter("a", "1", 1.0, {})),
                   lambda: scheduler.remove_adapter("a")):
        if "a" not in scheduler.adapters.loaded:
            on_engine(lambda: scheduler.install_adapter("a", Adapter("a", "2", 1.0, {})))
        adapted = greedy_request("on-a", [9, 10, 11], n=10)
        adapted.lora = "a"
        scheduler.submit([adapted])
        adapted.future.result(timeout=WAIT_S)
        entries = list(scheduler.prefix_cache._entries.values())
        assert {e.lora for e in entries} == {None, "a"} and any(e.tokens[:4] == base for e in entries)
        on_engine(change)
        assert list(scheduler.prefix_cache._entries.values()) == [e for e in entries if e.lora is None]
    on_engine(lambda: scheduler.install_adapter("a", Adapter("a", "3", 1.0, {})))
    spanning = greedy_request("spans-a", [9, 10, 11], n=300)
    spanning.lora = "a"
    started(spanning)
    on_engine(lambda: scheduler.install_adapter("a", Adapter("a", "4", 1.0, {})))  # mid-request
    spanning.future.result(timeout=WAIT_S)
    assert len(spanning.output_ids) == 300 and "a" not in {e.lora for e in scheduler.prefix_cache._entries.values()}
    on_engine(lambda: scheduler.release_memory(("kv_cache",)))
    assert len(scheduler.prefix_cache) == 0 and scheduler._kv_bytes() == 0


def test_the_engine_config_turns_the_cache_off_and_a_load_flushes_it_unless_told_not_to(tiny_model_dir: Path) -> None:
    """``engine.prefix_cache_tokens`` reaches the embedded engine a rollout server starts; a load from disk keeps
    the cache with ``flush_cache`` false (what the receiver sends with ``checkpoint.kv_on_swap: keep``)."""

    async def cached_turns(overrides: list[str]) -> list[int]:
        cfg = load_config(None, overrides)
        async with AsyncExitStack() as stack:
            [url], key = await engine_urls(cfg.engine, tiny_model_dir, stack)
            client = await stack.enter_async_context(EngineClient(url, api_key=key))
            params = {"temperature": 0.0, "max_new_tokens": 6}
            conversation, cached = [5, 6, 7, 8], []
            for flush in (None, False, True, None):
                if flush is not None:
                    await client.update_weights_from_disk(str(tiny_model_dir), "1", flush_cache=flush)
                reply = await client.generate(conversation, params)
                cached.append(reply["meta_info"]["cached_tokens"])
                conversation = conversation + reply["output_ids"] + TOOL_ANSWER
            return cached

    assert asyncio.run(cached_turns(["engine.prefix_cache_tokens=0"])) == [0, 0, 0, 0]
    # turns of 4, 13, 22 and 31 tokens: each takes all but its last 4 from the cache, except after the flush
    assert asyncio.run(cached_turns([])) == [0, 13 - 4, 0, 31 - 4]
