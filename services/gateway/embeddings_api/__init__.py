"""OpenAI's Embeddings API (`POST /v1/embeddings`), served by a worker started with `--runner pooling`."""
