"""The `receipt` field of /v1/chat/completions, /v1/completions and /completion.

With `"receipt": true` a route makes a `ReceiptMaker` (kinetic/receipts) before the request
runs, feeds it every delta of the answer, and adds `maker.receipt()` to the answer: the whole
answer's object, or the last event before `[DONE]` of a stream. Signed with the server's
--sign-key, which the CLI checked at start (serve_cli.serve_options).
"""

from __future__ import annotations

import asyncio
import threading

from kinetic.api.core import ServerState
from kinetic.api.errors import APIError
from kinetic.engine.request import GenerationRequest
from kinetic.receipts import ReceiptError, ReceiptMaker, Signer, load_signing_key

_signers: dict[str, Signer] = {}
_lock = threading.Lock()


def use_signing_key(path: str) -> Signer:
    """The Signer of a key file, read once and kept (the CLI reads --sign-key at start, so a
    bad key fails there, and a key file removed later still signs). Raises ReceiptError."""
    with _lock:
        if path not in _signers:
            _signers[path] = load_signing_key(path)
        return _signers[path]


def signer(state: ServerState) -> Signer | None:
    """The server's signing key (--sign-key); None without one."""
    return use_signing_key(state.config.sign_key) if state.config.sign_key else None


async def receipt_maker(state: ServerState, gen: GenerationRequest) -> ReceiptMaker:
    """A maker for `gen`'s receipt. Its first use hashes the model file (once per file, in a
    worker thread: seconds for a large file); 500 if the file or the key cannot be read."""
    model = state.require_model()

    def make() -> ReceiptMaker:
        return ReceiptMaker(model.engine, gen, signer(state), model.loaded.file.path)
    try:
        return await asyncio.to_thread(make)
    except (OSError, ReceiptError) as e:
        raise APIError(500, f"cannot make a receipt: {e}") from None
