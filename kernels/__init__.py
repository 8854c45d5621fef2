"""Triton kernels for the paged KV cache. Built by the Triton kernels issue."""
