"""kinetic: an LLM inference engine on JAX/XLA for GGUF models.

    import kinetic
    model = kinetic.load("model.gguf")   # see kinetic/llm.py
"""

__version__ = "0.1.0"


def load(path, **kwargs):
    """Load a GGUF model: see `kinetic.llm.load`."""
    from kinetic.llm import load as _load
    return _load(path, **kwargs)
