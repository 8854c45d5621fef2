"""The SLO planner: sizes the prefill and decode tiers (or the unified tier) from live load.

profile.py (the performance model file and its online refit), forecast.py and capacity.py (the
predictive sizing), policy.py (the decisions, predictive or reactive), simulator.py (a simulated
cluster to drive a policy in a closed loop), reader.py (the gateway's and workers' /metrics into an
Observation), metrics.py (the planner's own series), loop.py (scrape, decide, log, scale), cli.py.
Torch-free except profiler.py (`splitserve profile`), so the planner can run beside the gateway.
"""
