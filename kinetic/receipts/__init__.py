"""Receipts: the record of one answer, that anyone holding the model file can re-run.

    maker = ReceiptMaker(engine, request, signer=signer)    # before the request runs
    maker.feed(delta)                                       # every Delta of its answer
    receipt = maker.receipt()                               # a JSON object
    result = verify_receipt(receipt, model="SmolLM2-135M-Instruct.Q4_1.gguf")
    result.status, result.message, result.exit_code        # "verified", "differs", "unusable"

A receipt holds (names any tool can read; `canonical` is its byte form: sorted keys, no
spaces, UTF-8, floats as Python writes them, which read back to the same floats):
- `version` (RECEIPT_VERSION);
- `model`: the file's `name`, `size` and `sha256` (hashed once per file: `model_record`);
- `engine`: what decides the bits: kinetic's version, the JAX backend and device, the weight
  kernel (kinetic's C++ kernel reads the GGUF blocks; XLA's dot dense weights of a dtype), the
  activation rounding, the step's row buckets, the context, pages, KV dtype and the sampler's
  fixed widths;
- `request`: the prompt's token ids, every sampling parameter as the engine used it (the seed
  it drew when the request had none), `grammar` (what the answer's grammar was compiled
  from, GBNF, a JSON Schema, json_object or a forced tool call, with a digest of the compiled
  tables), `stop`, `max_tokens` and `special_text`;
- `output`: the token ids the engine emitted (the one that completed a stop string included,
  an end-of-generation token not), their `text` and the engine's `finish_reason`;
- `signature` (with a signing key): Ed25519 over the canonical form of everything else, with
  the signer's raw public key, both base64.

Verifying (`verify_receipt`) re-derives the answer from the request alone: the prompt and
the output run teacher-forced through the engine (Engine.score: the logits of every position,
by the same steps as generation, so bitwise those the answer was sampled from,
docs/architecture.md); then every position is sampled again by the engine's own runner at one
row (a row's bits do not depend on its batch: tests/test_invariance.py), its inputs built by
the function that builds serving's (kinetic/engine/sample_batch.py), and the tokens go through
the engine's own `Job` (end-of-generation, grammar, stop strings, Mirostat's state, text), so
that the finish is re-derived too.

record.py makes the parts, signing.py signs and checks signatures, verify.py re-runs; the
server's side is kinetic/api/receipt.py, the command's kinetic/cli.py (keygen, verify-receipt).
"""

from kinetic.receipts.record import (RECEIPT_VERSION, ReceiptError, ReceiptMaker, canonical,
                                     compile_grammar, engine_record, grammar_digest,
                                     grammar_record, model_record, request_record)
from kinetic.receipts.signing import (Signer, check_signature, load_signing_key,
                                      parse_public_key, write_signing_key)
from kinetic.receipts.verify import TokenInfo, Verification, verify_receipt

__all__ = ["RECEIPT_VERSION", "ReceiptError", "ReceiptMaker", "Signer", "TokenInfo",
           "Verification", "canonical", "check_signature", "compile_grammar", "engine_record",
           "grammar_digest", "grammar_record", "load_signing_key", "model_record",
           "parse_public_key", "request_record", "verify_receipt", "write_signing_key"]
