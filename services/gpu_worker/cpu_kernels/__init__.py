"""Plain-C CPU kernels of the worker, compiled with gcc on first use (build.py) and called through ctypes.

    paged_attention   fused paged decode attention (short query chunks too), fp32, OpenMP over tokens
"""
