"""The engine: continuous batching over a paged KV cache, on one thread of its own.

A request, in order: Engine.start (engine.py, the bridge to the engine thread) takes a
GenerationRequest (request.py) and makes its Job (job.py: stop strings, UTF-8, logprobs, the
grammar's matcher); each turn of the engine thread (turn.py, the Stepper) the Scheduler
(scheduler.py, pure Python, with fairness.py, prefix_reuse.py and prefills.py, its Sequence
and StepPlan in sequence.py, and kv_cache.py's pages and prefix cache) packs the step's rows,
the Runner (runner.py, the only caller of the device) runs the model's step, each sampled row
becomes sampling inputs (sample_batch.py, pure numpy, the same builder receipts verify with)
that Runner.sample draws (sample_device.py, over the jitted sampler.py), grammar_step.py
masks and budgets grammar rows, decode_steps.py runs several greedy steps in one call, and
the Job turns the tokens into Deltas for the request's sink, until it finishes. encoder.py
runs embedding and ranking models through the same runner.
"""
