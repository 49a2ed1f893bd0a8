"""The link between scheduler and worker cut (the worker on a test host in its own network namespace, the veth
taken down): keepalive notices within seconds, the requests are preempted, and when the link is back the worker
reattaches and every request completes with transformers' greedy text; then a new request is served, still
greedy-exact, and at idle every KV block is free."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.integration.cluster import Cluster, assert_healthy_and_no_leak
from tests.integration.netns import HOST_ADDR, LinkedNamespace, netns_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 for network namespaces")]

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of Italy is", "Photosynthesis is the process"]
MAX_TOKENS = 40


def test_cut_link_is_detected_and_recovered(tmp_path, model_dir, hf):
    with LinkedNamespace(f"sl{int(time.time()) % 100000}") as ns:
        cluster = Cluster(tmp_path, scheduler_args=["--scheduler-host", HOST_ADDR],
                          prefixes={"worker": ns.prefix()})
        cluster.scheduler_address = f"{HOST_ADDR}:{cluster.grpc_port}"
        cluster.argv["worker"][1] = cluster.argv["gateway"][3] = cluster.scheduler_address
        try:
            cluster.start()

            async def complete(client, prompt: str, first: asyncio.Event) -> str:
                stream = await client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                         max_tokens=MAX_TOKENS, stream=True)
                text = ""
                async for chunk in stream:
                    if chunk.choices:
                        text += chunk.choices[0].text
                        first.set()
                first.set()                 # a stream that ended at once must not leave the scenario waiting
                return text

            async def scenario():
                client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0,
                                            timeout=300)
                firsts = [asyncio.Event() for _ in PROMPTS]
                tasks = [asyncio.create_task(complete(client, p, first)) for p, first in zip(PROMPTS, firsts)]
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)   # both generating
                ns.cut()
                cut_at = time.monotonic()
                log = tmp_path / "scheduler.log"
                while "detached" not in log.read_text() and time.monotonic() - cut_at < 40:
                    await asyncio.sleep(0.2)        # a poll interval, up to a 40 s deadline
                detected = time.monotonic() - cut_at
                ns.restore()
                texts = await asyncio.wait_for(asyncio.gather(*tasks), 240)
                await client.close()
                return detected, texts

            detected, texts = asyncio.run(scenario())
            assert_healthy_and_no_leak(cluster, PROMPTS[0], 8,
                                       expect_text=hf.greedy_text(hf.text_ids(PROMPTS[0]), 8))
        finally:
            cluster.stop()
    assert detected < 25, f"cut link noticed only after {detected:.1f} s"
    for prompt, text in zip(PROMPTS, texts):
        assert text == hf.greedy_text(hf.text_ids(prompt), MAX_TOKENS), prompt
