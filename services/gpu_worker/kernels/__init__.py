"""Triton kernels of the worker, one module per kernel family, each a triad: @triton.jit kernel, a launcher that
checks its inputs and explains its grid, and a slow obvious torch reference (in `reference.py`).

    paged_attention   unified paged attention over one flat batch (prompt chunks + decodes), split-KV + reduce
    cache_write       write the step's new K/V into the paged cache by slot (slot -1 = skip)
    fused             RMSNorm (+ residual add), neox rotary in place on q and k, SiLU-and-mul

Importing any of these modules imports triton and decorates the kernels. Triton decides at decoration time
whether a kernel is interpreted (TRITON_INTERPRET=1) or compiled, so set that variable before the first import.
Nothing in the worker imports this package unless the triton backend is selected.
"""
