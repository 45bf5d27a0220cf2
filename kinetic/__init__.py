"""kinetic: an LLM inference engine on JAX/XLA for GGUF models.

    import kinetic
    model = kinetic.load("model.gguf")   # see kinetic/llm.py
    receipt = model.receipt("The capital of France is", max_tokens=8)
    kinetic.verify_receipt(receipt, model=model).message   # "verified: 8 tokens identical ..."
"""

__version__ = "0.1.0"


def load(path, **kwargs):
    """Load a GGUF model: see `kinetic.llm.load`."""
    from kinetic.llm import load as _load
    return _load(path, **kwargs)


def verify_receipt(receipt, model=None, **kwargs):
    """Check an answer's receipt by re-running it: see `kinetic.receipts.verify_receipt`."""
    from kinetic.receipts import verify_receipt as _verify
    return _verify(receipt, model, **kwargs)
