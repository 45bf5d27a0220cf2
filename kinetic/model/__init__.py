"""Models: GGUF files made into jit-compiled forward functions.

A model, in order: gguf_file.py reads the file's metadata and tensor table (memory-mapped)
-> loader.py picks the architecture module (llama.py, qwen3.py, gemma3.py, bert.py, ...),
whose `configure` fills config.py's Config -> weights.py makes the weight pytree, the GGUF
blocks kept as they are for the C++ kernel or dequantized (quants.py) for XLA -> the
architecture's `forward`, built from layers.py's shared pieces, is what runner.py compiles.
"""
