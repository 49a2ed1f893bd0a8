"""Quantized safetensors checkpoints (GPTQ, AWQ, compressed-tensors) kept at their stored width: config.py reads the
`quantization_config`, formats.py unpacks each format's tensors, linear.py multiplies in that form."""
