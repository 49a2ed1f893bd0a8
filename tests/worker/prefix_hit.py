"""A prefix-cache hit as the scheduler makes one, through the test driver: a prompt is served, then the same
prompt again as a new request that starts on the first request's full prompt blocks (num_computed_tokens = their
tokens), so its prefill computes only the rest over KV the first request wrote."""

from __future__ import annotations

from steploop.common.sampling_params import SamplingParams
from tests.worker.driver import Driver
from tests.worker.test_families import NEW_TOKENS, prompts


def serve_prefix_hit(runner, chunk: int = 512) -> dict[int, tuple[list[int], list[float]]]:
    """handle 0: the longest test prompt served cold; handle 1: the same prompt hitting 0's cached blocks.
    handle -> (tokens, logprobs), as test_families.serve gives them."""
    runner.reset()
    driver = Driver(runner)
    prompt = prompts()[-1]
    params = SamplingParams(temperature=0.0, logprobs=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    driver.add(0, prompt, NEW_TOKENS, params)
    blocks: list[int] = []
    while driver.requests:
        blocks = list(driver.requests[0].blocks)
        _collect(driver.step(chunk), logprobs)
    cached = (len(prompt) - 1) // driver.block_size           # full prompt blocks; one token is always computed
    assert cached >= 2, "the prompt should span several full blocks"
    hit = blocks[:cached]
    for block in hit:                                         # still holding the first request's KV
        driver.free.remove(block)
    driver.add(1, prompt, NEW_TOKENS, params)
    driver.requests[1].blocks = hit
    driver.requests[1].num_computed = cached * driver.block_size
    while driver.requests:
        _collect(driver.step(chunk), logprobs)
    runner.reset()
    return {h: (driver.outputs[h], logprobs[h][-NEW_TOKENS:]) for h in logprobs}


def _collect(result, logprobs: dict[int, list[float]]) -> None:
    for handle, lps in result.logprobs.items():
        logprobs[handle].extend(lp.logprob for lp in lps)
