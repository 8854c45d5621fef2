"""Workers: the engine (model, paged KV cache, scheduler) and the processes that run it."""
