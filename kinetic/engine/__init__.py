"""The engine: continuous batching over a paged KV cache, on one thread of its own.

A request, in order: Engine.start (engine.py) takes a GenerationRequest (request.py) and
makes its Job (job.py: stop strings, UTF-8, logprobs, the grammar's matcher); each turn of
the engine thread, the Scheduler (scheduler.py, pure Python, with kv_cache.py's pages and
prefix cache) packs the step's rows, the Runner (runner.py) runs the model's step on the
device, the sampler (sampler.py) draws each sampled row's token, and the Job turns the tokens
into Deltas for the request's sink, until it finishes. encoder.py runs embedding and ranking
models through the same runner.
"""
