"""Disaggregated prefill/decode: the handoff between tiers (decode.py, prefill.py, handoff.py) and the
KV transfer layer (transfer/). The whole lifecycle is described once, in handoff.py."""
