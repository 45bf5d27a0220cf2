"""Router mode: `kinetic serve` with no model serves many, each in a worker process of its own.

    catalog.py   the models it can serve: every pulled model and every GGUF of --models-dir
    workers.py   one `kinetic serve` process per loaded model: loaded on first use, the least
                 recently used unloaded past --models-max, or when its keep_alive runs out
    proxy.py     a request passed to its model's worker, its answer streamed back
    app.py       the router's own routes (llama-server's /models, Ollama's /api/tags, /ps,
                 /pull, /delete) and every other route passed on by the body's `model`

A worker is a whole `kinetic serve` of one model, on 127.0.0.1 with a key of its own that
only the router knows: each model keeps its own engine and determinism contract, a model
that fails to load fails only its own requests, and unloading ends the process, which hands
all its memory back to the system (an XLA runtime in one process does not).
"""
