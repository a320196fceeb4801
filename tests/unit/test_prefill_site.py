"""Conditional disaggregation: where a prompt is prefilled, decided from plain numbers."""

from __future__ import annotations

import pytest

from router.policy.prefill_site import PrefillSiteConfig, PrefillSitePolicy, SiteInputs


def inputs(prompt: int, cached: int = 0, queued: int = 0, pool: int | None = 10_000,
           chunk: int = 0) -> SiteInputs:
    return SiteInputs(prompt, cached, queued, pool, chunk)


def test_a_short_prompt_is_prefilled_by_the_decode_worker():
    decision = PrefillSitePolicy().decide(inputs(300, pool=300))
    assert decision.local and decision.reason == "short"
    assert "prompt 300 tokens" in decision.describe()


def test_a_long_prompt_goes_to_the_prefill_pool_when_it_is_free():
    decision = PrefillSitePolicy().decide(inputs(1500, pool=1500))
    assert not decision.local and decision.reason == "long"


def test_local_work_already_queued_counts_against_the_short_limit():
    policy = PrefillSitePolicy(PrefillSiteConfig(max_local_tokens=512))
    assert policy.decide(inputs(300, queued=200, pool=300)).local
    decision = policy.decide(inputs(300, queued=300, pool=300))
    assert not decision.local and decision.reason == "long"


def test_a_prompt_of_several_of_the_decode_workers_chunks_is_not_short():
    """The decode worker would take one step per chunk; an idle prefill worker takes one."""
    policy = PrefillSitePolicy(PrefillSiteConfig(max_local_tokens=512))
    assert policy.decide(inputs(32, pool=32, chunk=32)).local
    decision = policy.decide(inputs(33, pool=33, chunk=32))
    assert not decision.local and decision.reason == "long"
    assert "chunks of 32" in decision.describe()
    # what the decode worker caches does not count: 200 - 180 tokens fit in one chunk
    assert policy.decide(inputs(200, cached=180, pool=200, chunk=32)).reason == "short"
    # a backed-up pool still sends it local, chunks or not
    assert policy.decide(inputs(256, pool=4 * 256 + 1, chunk=32)).reason == "pool backed up"


def test_the_decode_workers_cached_prefix_is_not_local_work():
    policy = PrefillSitePolicy(PrefillSiteConfig(max_local_tokens=512))
    decision = policy.decide(inputs(2000, cached=1600, pool=2000))
    assert decision.local and decision.reason == "short"
    assert policy.local_tokens(inputs(64, cached=64)) == 1  # the last token is always computed


def test_a_backed_up_pool_sends_even_long_prompts_local():
    policy = PrefillSitePolicy(PrefillSiteConfig(max_local_tokens=256, local_cost_factor=4))
    assert not policy.decide(inputs(1000, pool=3999)).local
    decision = policy.decide(inputs(1000, pool=4001))
    assert decision.local and decision.reason == "pool backed up"


def test_without_a_usable_prefill_worker_the_decode_worker_prefills():
    decision = PrefillSitePolicy().decide(inputs(4000, pool=None))
    assert decision.local and decision.reason == "no prefill worker"


def test_off_always_uses_the_prefill_pool():
    policy = PrefillSitePolicy(PrefillSiteConfig(mode="off"))
    assert not policy.decide(inputs(10, pool=10)).local
    assert not policy.decide(inputs(10, pool=None)).local


@pytest.mark.parametrize("kwargs, field", [
    ({"mode": "sometimes"}, "--local-prefill"),
    ({"max_local_tokens": -1}, "--local-prefill-max-tokens"),
    ({"local_cost_factor": 0.5}, "local_cost_factor"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PrefillSiteConfig(**kwargs)
