"""The APIs kinetic speaks, one module each over the shared core (kinetic/api/core.py): a
dialect reads its own request fields and writes its own answer shapes, and nothing else.

openai.py (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/rerank), prefill.py
(/v1/prefill), llama_server.py with llama_completion.py (llama-server's /completion,
/tokenize, /props, /slots, /metrics, /health ...) and slot_actions.py (its slot save,
restore and erase, /apply-template), ollama.py (/api/*). No dialect imports another.
"""
