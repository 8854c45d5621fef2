"""The engine: requests, scheduler, model runner, sampler, detokenizer and the step loop."""
