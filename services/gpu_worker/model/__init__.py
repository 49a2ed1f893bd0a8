"""The model: a torch implementation of the Llama family that reads a paged KV cache."""
