"""KV events: what a scheduler's prefix cache holds, as vLLM publishes it (BlockStored / BlockRemoved /
AllBlocksCleared per step), over ZMQ in vLLM's wire format and over gRPC (Engine.WatchKVEvents, a snapshot
then ordered batches). Off unless --kv-events-config enables it; then recorder.py collects, hub.py numbers
and fans out."""
