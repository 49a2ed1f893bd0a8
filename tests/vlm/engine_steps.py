"""Steps a real scheduler and a real ModelRunner together to the end, checking the block invariants after every
step (the VLM engine tests' driver)."""

from __future__ import annotations


def run(sched, runner, requests, max_steps=400):
    """Step scheduler and worker to the end; returns request id -> output tokens."""
    out = {r.request_id: [] for r in requests}
    for r in requests:
        sched.add_request(r)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        plan = sched.schedule()
        result = runner.execute(plan)
        assert not result.error, result.error
        for o in sched.update_from_output(plan, result):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    runner.execute(sched.schedule())        # the last plan's frees reach the worker
    return out


def assert_images_never_share_a_block(sched, runner, a, b, block_size: int, expected: dict) -> None:
    """`a`, `b`: requests with the same token ids and one image each, other pixels. Served one after the other, they
    share the blocks before the image and none from it on; `expected`: request id -> the oracle's tokens."""
    out = run(sched, runner, [a])
    out |= run(sched, runner, [b])
    image_block = a.mm_features[0].offset // block_size
    assert a.block_hashes[:image_block] == b.block_hashes[:image_block]    # text before the image is shared
    assert not set(a.block_hashes[image_block:]) & set(b.block_hashes[image_block:])
    assert b.num_cached_tokens == image_block * block_size
    assert out == expected
