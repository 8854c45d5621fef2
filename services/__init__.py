"""Everything that runs behind the gateway: workers, engine, model, KV handoff, planner, launcher."""
