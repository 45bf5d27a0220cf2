"""kinetic: an LLM inference engine on JAX/XLA for GGUF models.

    import kinetic
    model = kinetic.load("model.gguf")   # see kinetic/llm.py
    receipt = model.receipt("The capital of France is", max_tokens=8)
    kinetic.verify_receipt(receipt, model=model).message   # "verified: 8 tokens identical ..."
"""

import os

__version__ = "0.1.0"

# XLA's CPU compiler without its MLIR fusion emitters (XLA's older LLVM emitters instead).
# Measured on Gemma 3 270M (docs/performance.md): the same logits and tokens bit for bit, and
# about 240 MB less peak memory, most of it the MLIR state those emitters keep once any
# program has compiled, the rest about 20-50 MB per sampler executable. XLA reads XLA_FLAGS
# once, when JAX's CPU backend starts: this runs first on any `import kinetic...`. A setting
# of the flag already in XLA_FLAGS is kept (tests/test_xla_flags.py compares the two).
XLA_FLAG = "--xla_cpu_use_fusion_emitters"
if XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_FLAG}=false".strip()


def load(path, **kwargs):
    """Load a GGUF model: see `kinetic.llm.load`."""
    from kinetic.llm import load as _load
    return _load(path, **kwargs)


def verify_receipt(receipt, model=None, **kwargs):
    """Check an answer's receipt by re-running it: see `kinetic.receipts.verify_receipt`."""
    from kinetic.receipts import verify_receipt as _verify
    return _verify(receipt, model, **kwargs)
