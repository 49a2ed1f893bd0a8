"""`steploop bench`: load generation and latency/throughput metrics for OpenAI-compatible servers."""
