"""OpenAI's Batch API (/v1/files, /v1/batches): JSONL jobs stored on disk, run through this gateway's own endpoints
at the lowest priority, resumed after a restart."""
