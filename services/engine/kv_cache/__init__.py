"""Paged KV cache bookkeeping: block hashes, the block pool and the per-request KV cache manager.

Everything in this package is torch-free so the gateway and the prefix index can import the hash
function without pulling in torch.
"""
