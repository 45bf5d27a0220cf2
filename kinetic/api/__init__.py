"""The HTTP server: OpenAI's, llama-server's and Ollama's APIs over one engine.

A request, in order: server.py's accept loop (the connection limit) and Hypercorn ->
access.py's guard (Host, Origin, API key, body type and size) -> the dialect's route
(dialects/: openai.py, llama_server.py, ollama.py, prefill.py, slot_actions.py) ->
core.json_body -> params.py's parser, run with the prompt's rendering and tokenizing in a
worker thread (offload.py) -> core.generation, the engine's deltas for the request -> the
answer, streamed (SSE, NDJSON) or folded whole; every error in the dialect's shape
(errors.py, access.py).
"""
