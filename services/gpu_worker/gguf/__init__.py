"""GGUF files read directly: config and tokenizer from the metadata, weights tensor by tensor from the memory-mapped
file into the packed kernels' forms (blocks.py, weights.py), never a whole fp32 copy."""
