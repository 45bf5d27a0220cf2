"""Verifying a receipt: signature, model file, then the answer re-derived through the engine."""

from __future__ import annotations

import json
import os
import stat
import threading
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kinetic import __version__
from kinetic.engine.engine_config import KV_VALUE_BYTES
from kinetic.engine.sample_batch import (HISTORY_WIDTH, MAX_CANDIDATES, sample_batches,
                                         sample_row)
from kinetic.receipts.record import (RECEIPT_VERSION, ReceiptError, _is_int, _need,
                                     _rebuild_request, _weights, model_record)
from kinetic.receipts.signing import Tampered, check_signature, fingerprint, parse_public_key

FINISH_REASONS = ("stop", "length", "cancelled")

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class TokenInfo:
    """A token at one position: its id, text and log-probability under the raw logits."""

    token: int
    text: str
    logprob: float


@dataclass(frozen=True)
class Verification:
    """What `verify_receipt` found.

    status: "verified" (every output token re-derived identical, and the finish), "differs"
    (the first difference is at `position`, an index into output.token_ids: the receipt's
    token and the engine's, either None where one answer has ended) or "unusable" (the
    receipt cannot be checked: `message` says why). `n_tokens` counts the identical tokens
    before any difference; `signed_by` is the signer's public key (base64) when the
    signature holds, and `trusted` whether it is the key the caller asked for (`public_key`):
    without one, a signature only shows that the receipt is whole, not who made it (anyone
    can sign with a key of their own); `notes` are remarks that did not stop the check
    (another device, an untrusted signer)."""

    status: str
    message: str
    n_tokens: int = 0
    position: int | None = None
    receipt_token: TokenInfo | None = None
    engine_token: TokenInfo | None = None
    signed_by: str | None = None
    trusted: bool = False
    notes: tuple[str, ...] = ()

    @property
    def signer(self) -> str | None:
        """The signer's key fingerprint (signing.fingerprint), None when unsigned."""
        return None if self.signed_by is None else fingerprint(self.signed_by)

    @property
    def ok(self) -> bool:
        return self.status == "verified"

    @property
    def exit_code(self) -> int:
        """kinetic verify-receipt's: 0 verified, 1 differs, 2 unusable."""
        return {"verified": 0, "differs": 1}.get(self.status, 2)


def _unusable(message: str, **kw) -> Verification:
    return Verification("unusable", f"cannot check the receipt: {message}", **kw)


def verify_receipt(receipt: dict | str | bytes | os.PathLike, model=None, *,
                   public_key: str | bytes | None = None,
                   progress: Progress | None = None) -> Verification:
    """Check a receipt: its signature (and with `public_key`, base64 or a key file, that this
    key signed it), the model file's size and SHA-256, then re-run the prompt and the output
    teacher-forced through the engine, re-sample every position with the recorded seed and
    parameters and re-derive the finish. Returns a Verification; never raises for a bad receipt.

    receipt: the object, its JSON text (str or bytes) or a path to it (os.PathLike); or a whole
    answer that carries one (its `receipt`, or each choice's: then every choice's receipt is
    checked, and the first that is not verified is returned). model: the GGUF file's path, a
    loaded kinetic.llm.Model (its engine is used when its settings are the receipt's, else a new
    engine over its weights), or None: the file of the receipt's name in kinetic's model cache
    (kinetic.fetch.cache_dir). progress(done, total) follows the positions re-sampled."""
    try:
        parts = _parse(receipt)
        key = parse_public_key(public_key) if isinstance(public_key, str) else public_key
    except ReceiptError as e:
        return _unusable(str(e))
    found = []
    for where, rec, shown in parts:
        one = _verify_one(rec, shown, model, key, progress)
        if where and not one.ok:
            return dataclasses.replace(one, message=f"{where}'s receipt: {one.message}")
        found.append(one)
    if len(found) == 1:
        return found[0]
    return dataclasses.replace(found[0], n_tokens=sum(f.n_tokens for f in found), message=(
        f"verified: the receipts of all {len(found)} choices ("
        + "; ".join(f"{w}: {f.message.removeprefix('verified: ')}"
                    for (w, _, _), f in zip(parts, found)) + ")"))


def _verify_one(rec: dict[str, Any], shown: list, model, key: bytes | None,
                progress: Progress | None) -> Verification:
    try:
        try:
            signed_by = check_signature(rec, key)
        except Tampered as e:
            # changed after signing: re-run it anyway, so that a changed token is named (exit
            # 1); a receipt whose every token still re-derives is refused for the signature
            found = _verify(rec, model, None, progress)
            if found.status == "differs":
                return dataclasses.replace(found, message=f"{found.message} (and {e})")
            return _unusable(str(e))
        found = _verify(rec, model, signed_by, progress)
        if found.status == "verified":
            found = _check_shown(found, shown, rec["output"]["text"])
        if signed_by is None or found.status == "unusable":
            return found
        if key is not None:
            return dataclasses.replace(found, trusted=True)
        return dataclasses.replace(found, notes=found.notes + (
            f"signed by key {fingerprint(signed_by)} ({signed_by}), but no trusted key was "
            f"given: the signature shows the receipt is whole, not who made it (anyone can "
            f"sign with a key of their own); pass --public-key to check the signer",))
    except ReceiptError as e:
        return _unusable(str(e))
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        # a field of a type or size no check above foresaw: still a bad receipt, not a crash
        return _unusable(f"a field is not what kinetic writes there ({e})")


# a receipt file larger than this is refused before it is read: a receipt holds a context's
# token ids (a few bytes each) and its request, far below this
MAX_RECEIPT_BYTES = 64 << 20


def _parse(receipt) -> list[tuple[str, dict[str, Any], list[tuple[str, Any, str]]]]:
    """[(where, receipt, the visible texts of the answer it came in: _shown)]: one receipt
    (where ""), or a whole answer's: its own, or each of its choices' (where "choices[i]")."""
    if isinstance(receipt, os.PathLike):
        try:
            with open(receipt, "rb") as f:
                if os.fstat(f.fileno()).st_size > MAX_RECEIPT_BYTES:
                    raise ReceiptError(f"{receipt} is larger than a receipt can be "
                                       f"({MAX_RECEIPT_BYTES >> 20} MiB)")
                receipt = f.read(MAX_RECEIPT_BYTES + 1)
        except OSError as e:
            raise ReceiptError(f"cannot read {receipt}: {e.strerror or e}") from None
    if isinstance(receipt, (str, bytes)):
        if len(receipt) > MAX_RECEIPT_BYTES:
            raise ReceiptError(f"larger than a receipt can be ({MAX_RECEIPT_BYTES >> 20} MiB)")
        try:
            receipt = json.loads(receipt)
        except (ValueError, RecursionError) as e:
            raise ReceiptError(f"not JSON: {e}") from None
    if not isinstance(receipt, dict):
        raise ReceiptError("a receipt is a JSON object")
    parts = [("", receipt, [])]
    if "version" not in receipt:   # a whole answer, saved as the server sent it
        choices = receipt.get("choices")
        choices = [(i, c) for i, c in enumerate(choices if isinstance(choices, list) else [])
                   if isinstance(c, dict)]   # each with its index in the answer
        if isinstance(receipt.get("receipt"), dict):
            parts = [("", receipt["receipt"], _shown(receipt))]
        elif any(isinstance(c.get("receipt"), dict) for _, c in choices):
            parts = [(f"choices[{i}]", c.get("receipt"), _choice_shown(i, c))
                     for i, c in choices]
    for where, rec, _ in parts:
        if not isinstance(rec, dict):
            raise ReceiptError(f"{where} has no receipt")
        version = rec.get("version")
        if not _is_int(version) or version != RECEIPT_VERSION:
            raise ReceiptError(f"unknown receipt version {version!r} (this kinetic reads "
                               f"version {RECEIPT_VERSION})")
        for part in ("model", "engine", "request", "output"):
            if not isinstance(rec.get(part), dict):
                raise ReceiptError(f"the receipt has no {part} object")
    return parts


def _shown(answer: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(where, text, how) of each text a whole answer shows its reader. how: "equal" (
    /completion's `content` is the receipt's text itself), "end" (a /v1/completions choice's
    `text` ends with it: an `echo` would put the prompt first), "chat" (a chat message: text is
    its (reasoning_content, content, has tool calls), the receipt's text taken apart: _chat)."""
    out = []
    if isinstance(answer.get("content"), str):
        out.append(("content", answer["content"], "equal"))
    choices = answer.get("choices")
    for i, choice in enumerate(choices if isinstance(choices, list) else []):
        if isinstance(choice, dict):
            out += _choice_shown(i, choice)
    return out


def _choice_shown(i: int, choice: dict[str, Any]) -> list[tuple[str, Any, str]]:
    out = []
    if isinstance(choice.get("text"), str):
        out.append((f"choices[{i}].text", choice["text"], "end"))
    message = choice.get("message")
    if isinstance(message, dict):
        reasoning, content = message.get("reasoning_content"), message.get("content")
        out.append((f"choices[{i}].message", (
            reasoning if isinstance(reasoning, str) else "",
            content if isinstance(content, str) else "", bool(message.get("tool_calls"))),
            "chat"))
    return out


def _check_shown(found: Verification, shown: list[tuple[str, Any, str]],
                 text: str) -> Verification:
    """found, or "differs" where the answer shows a text the verified receipt does not
    hold: its tokens re-derive, but a reader was shown something else."""
    for where, value, how in shown:
        ok = (value == text if how == "equal" else text.endswith(value) if how == "end"
              else _chat(text, *value))
        if not ok:
            seen = value if how != "chat" else value[1] or value[0]
            return dataclasses.replace(found, status="differs", message=(
                f"the answer's {where} is not the receipt's text (its {found.n_tokens} tokens "
                f"re-derive, but the answer shows {seen[:80]!r}, the receipt's text is "
                f"{text[:80]!r})"))
    return found


def _chat(text: str, reasoning: str, content: str, calls: bool) -> bool:
    """Whether a chat message's reasoning and content are the receipt's text taken apart as
    the server takes it (api/chat_reply.py): whole, or split at <think> ... </think> (the
    prompt leaving the block open or not). With tool calls, the calls' markup was taken out of
    the content, so the content need only be in the rest."""
    from kinetic.chat.reasoning import ReasoningSplitter
    splits = [("", text)]
    for started_open in (False, True):
        splitter = ReasoningSplitter(started_open)
        (r1, c1), (r2, c2) = splitter.feed(text), splitter.finish()
        splits.append((r1 + r2, c1 + c2))
    return any(r == reasoning and (content in c if calls else c == content)
               for r, c in splits)


def _find_model(name: str) -> str:
    """The file of that name in kinetic's model cache: a registry model's, else one pulled
    from Hugging Face (the first, by path, of those with that name)."""
    from kinetic.fetch import MODELS, cache_dir
    from kinetic.hub import cached_files
    if (os.path.basename(name) != name or "\\" in name or "\0" in name
            or name in ("", ".", "..") or len(name.encode("utf-8", "replace")) > 255):
        raise ReceiptError(f"the receipt's model name {name[:80]!r} is not a file name; give "
                           f"its file with --model MODEL")
    path = cache_dir() / name
    if path.is_file():
        return str(path)
    pulled = [p for _, p in cached_files() if p.name == name]
    if pulled:
        return str(pulled[0])
    keys = [k for k, s in MODELS.items() if s.filename == name]
    hint = f", or pull it: kinetic pull {keys[0]}" if keys else ""
    raise ReceiptError(f"the receipt's model {name} is not in kinetic's model cache "
                       f"({cache_dir()}); give its file with --model MODEL{hint}")


def _check_model_file(path: str, want: dict[str, Any]) -> None:
    name, size, digest = (_need(want, "name", str, "model"), _need(want, "size", int, "model"),
                          _need(want, "sha256", str, "model"))
    try:
        st = os.stat(path)
    except OSError as e:
        raise ReceiptError(f"cannot read the model file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ReceiptError(f"the model {path} is not a file")
    wanted = f"the receipt's model is {name} ({size} bytes, sha256 {digest})"
    try:
        got = model_record(path)["sha256"]   # hashed once per file, as for receipts
    except OSError as e:
        raise ReceiptError(f"cannot read the model file {path}: {e.strerror or e}") from None
    if st.st_size != size or got != digest:
        raise ReceiptError(f"wrong model file: {wanted}; {path} has {st.st_size} bytes, "
                           f"sha256 {got}")


def _verify(rec: dict[str, Any], model, signed_by: str | None,
            progress: Progress | None) -> Verification:
    output = rec["output"]
    out_ids = _need(output, "token_ids", list, "output")
    if not all(_is_int(t) for t in out_ids):
        raise ReceiptError("output.token_ids must be a list of token ids")
    text = _need(output, "text", str, "output")
    finish = output.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise ReceiptError(f"output.finish_reason must be one of {', '.join(FINISH_REASONS)}, "
                           f"got {finish!r}")
    request, seed = _rebuild_request(rec["request"])
    path = model if isinstance(model, (str, os.PathLike)) else None
    if model is not None and path is None:
        path = model.loaded.file.path
    path = os.fspath(path) if path is not None else _find_model(
        _need(rec["model"], "name", str, "model"))
    _check_model_file(path, rec["model"])
    eng_rec = rec["engine"]
    n_ctx = _need(eng_rec, "n_ctx", int, "engine")
    # every token is scored, the last one too (the answer may end after it by an
    # end-of-generation token): the verifier's context is widened past the receipt's when
    # the answer filled it (the receipt's own n_ctx still rules the sampler and the finish)
    tokens = list(request.prompt) + list(out_ids)
    widths = _widths(eng_rec, n_ctx)   # before any engine is made
    engine, notes = _engine_for(eng_rec, path, model, len(tokens) + 1)
    bad = [t for t in tokens if not 0 <= t < engine.vocab_size]
    if bad:
        raise ReceiptError(f"token id {bad[0]} is outside the model's vocabulary")
    if progress:
        progress(0, len(out_ids) + 1)
    try:
        logits = engine.score(tokens)   # [len(tokens), V]: row j gives token j + 1
    except (ValueError, RuntimeError) as e:
        raise ReceiptError(f"the engine cannot run the receipt's tokens: {e}") from None
    return _replay(engine, request, seed, out_ids, text, finish, logits, widths, n_ctx,
                   signed_by, tuple(notes), progress)


# (weights, activation_rounding) a receipt of each kernel can record (record._weights)
_KERNEL_WEIGHTS = {"ffi": {("gguf", "llama.cpp")}, "pallas": {("gguf", "none")},
                   "xla": {(w, r) for w in ("bfloat16", "float32", "float16")
                           for r in ("llama.cpp", "none")}}


def _widths(rec: dict[str, Any], n_ctx: int) -> dict[str, int]:
    """The sampler's widths a receipt's engine record gives (this kinetic's where it gives
    none), each at most what kinetic runs: ReceiptError otherwise."""
    widths = {"history_width": rec.get("history_width", min(HISTORY_WIDTH, n_ctx)),
              "max_candidates": rec.get("max_candidates", MAX_CANDIDATES)}
    for name, most in (("history_width", HISTORY_WIDTH), ("max_candidates", MAX_CANDIDATES)):
        if not _is_int(widths[name]) or not 1 <= widths[name] <= most:
            raise ReceiptError(f"the receipt's engine.{name} must be an integer from 1 to "
                               f"{most} (what kinetic runs), got {str(widths[name])[:40]}")
    return widths


# verification engines, kept for the next receipt of the same model and settings
_engines: dict[tuple, Any] = {}
_engines_lock = threading.Lock()


def _engine_for(rec: dict[str, Any], path: str, model, need_ctx: int):
    """An engine that computes the receipt's bits: `model`'s own when its settings match,
    else one made (and kept) with the receipt's settings. Returns (engine, notes)."""
    import jax

    from kinetic.engine.engine import Engine
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.model.loader import load_model
    from kinetic.text.tokenizer import Tokenizer
    notes = []
    kernel = _need(rec, "kernel", str, "engine")
    weights, rounding = rec.get("weights"), rec.get("activation_rounding")
    step_tokens = _need(rec, "step_tokens", int, "engine")
    page_size = _need(rec, "page_size", int, "engine")
    kv_dtype = _need(rec, "kv_dtype", str, "engine")
    n_ctx = _need(rec, "n_ctx", int, "engine")
    backend, device = _need(rec, "backend", str, "engine"), _need(rec, "device", str, "engine")
    # bounds of what kinetic serve runs, so that a crafted receipt cannot ask for a huge step
    if not (1 <= step_tokens <= 4096 and 1 <= page_size <= 4096 and page_size <= n_ctx
            and kv_dtype in KV_VALUE_BYTES
            and kernel in ("ffi", "xla", "pallas")
            and (weights, rounding) in _KERNEL_WEIGHTS[kernel]):
        raise ReceiptError(f"the receipt's engine settings are not ones kinetic runs "
                           f"(kernel {kernel!r}, weights {weights!r}, activation_rounding "
                           f"{rounding!r}, step_tokens {step_tokens}, page_size {page_size}, "
                           f"kv_dtype {kv_dtype!r}, n_ctx {n_ctx})")
    split = rec.get("split") or {}
    if not isinstance(split, dict):
        raise ReceiptError("the receipt's engine.split must be an object")
    if rec.get("version") != __version__:
        notes.append(f"the receipt was made by kinetic {rec.get('version')}; this is "
                     f"{__version__}")
    if split.get("mode", "none") != "none":
        notes.append(f"the answer was made split by {split['mode']} over "
                     f"{split.get('devices')} devices; it is re-run on one, which gives a "
                     f"split's bits")
    here = (jax.default_backend(), jax.devices()[0].device_kind)
    if backend == "gpu" and (backend, device) != here:
        # a GPU's float order is its compiled kernels' (Triton's, per chip): only the same
        # kind of device re-derives the same bits
        raise ReceiptError(f"the receipt was made on a GPU ({device}, kernel "
                           f"{kernel}); re-running it needs that kind of device, and this "
                           f"is {here[0]} ({here[1]})")
    if backend != here[0] or device != here[1]:
        notes.append(f"the receipt was made on {backend} ({device}); this is {here[0]} "
                     f"({here[1]})")

    def same(e) -> bool:
        c = e.config
        return (e.model.config.kernel == kernel and _weights(e.model) == (weights, rounding)
                and c.step_tokens == step_tokens and c.page_size == page_size
                and c.kv_dtype == kv_dtype and e.max_context >= need_ctx)

    if model is not None and not isinstance(model, (str, os.PathLike)) and same(model.engine):
        return model.engine, notes
    st = os.stat(path)
    ctx = max(n_ctx, -(-need_ctx // page_size) * page_size)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, kernel, weights, rounding,
           step_tokens, page_size, kv_dtype, ctx)
    with _engines_lock:
        if key not in _engines:
            loaded = tok = None
            if model is not None and not isinstance(model, (str, os.PathLike)):
                if (model.loaded.config.kernel == kernel
                        and _weights(model.loaded) == (weights, rounding)):
                    # its tokenizer too: the file's merges are gone (GGUFFile.drop)
                    loaded, tok = model.loaded, model.tokenizer
            try:
                if loaded is None:
                    loaded = load_model(path, dtype=weights if kernel == "xla" else "bfloat16",
                                        act_quant=rounding == "llama.cpp", kernel=kernel)
                    tok = Tokenizer.from_metadata(loaded.file.metadata)
                config = EngineConfig(parallel=1, n_ctx=ctx, step_tokens=step_tokens,
                                      page_size=page_size, kv_dtype=kv_dtype, speculative=False,
                                      max_draft=0, host_cache_mb=0)
                engine = Engine(loaded, tok, config)
            except (ValueError, TypeError, RuntimeError) as e:
                raise ReceiptError(f"cannot run the receipt's engine here ({kernel} kernel, "
                                   f"{weights} weights): {e}") from None
            _engines[key] = engine
        return _engines[key], notes


def _replay(engine, request, seed: int, out_ids: list[int], text: str, finish: str,
            logits: np.ndarray, widths: dict[str, int], n_ctx: int, signed_by: str | None,
            notes: tuple[str, ...], progress: Progress | None) -> Verification:
    """Sample every output position again as the engine did, one row at a time, through a
    Job of the request (its matcher, bias, DRY and Mirostat state, stop strings, decoder),
    and one position more where the answer may have ended by an end-of-generation token."""
    from kinetic.engine.job import Job
    deltas: list = []
    vocab = engine.grammar_vocab() if request.grammar is not None else None
    job = Job(0, request, deltas.append, engine.tokenizer, seed, vocab=vocab)
    tokens = list(request.prompt) + list(out_ids)
    n, start = len(out_ids), len(request.prompt)
    # the receipt's sampler shape: its context and widths, the engine's bias width
    shape = dataclasses.replace(engine.sample_shape, n_ctx=n_ctx, buckets=(1,), **widths)
    info = _TokenInfo(engine, logits)
    base = dict(signed_by=signed_by, notes=notes)

    def differs(i: int, why: str, mine: TokenInfo | None, theirs: TokenInfo | None):
        return Verification("differs", f"differs at output position {i}: {why}", n_tokens=i,
                            position=i, receipt_token=mine, engine_token=theirs, **base)

    ended: str | None = None
    for i in range(n + 1):
        pos = start + i   # the index the drawn token takes; its logits are the row before
        # the scheduler ends a sequence at max_tokens or past the context (length)
        if (request.max_tokens is not None and i >= request.max_tokens) or pos > n_ctx:
            if i < n:
                return differs(i, f"the answer ends there (length: max_tokens "
                               f"{request.max_tokens}, context {n_ctx}), but the receipt goes "
                               f"on with {info.describe(pos - 1, out_ids[i])}",
                               info.get(pos - 1, out_ids[i]), None)
            ended = "length"
            break
        if i == n and finish == "cancelled":
            break   # a cancelled answer ends where it was cut: nothing to re-derive
        tok, new_mu = _budgeted(i, lambda: _sample_row(engine, job, logits[pos - 1],
                                                       tokens[:pos], pos, shape))
        if i < n and tok != out_ids[i]:
            return differs(i, f"the receipt has {info.describe(pos - 1, out_ids[i])}; the "
                           f"engine draws {info.describe(pos - 1, tok)}",
                           info.get(pos - 1, out_ids[i]), info.get(pos - 1, tok))
        job.pending_mu = new_mu
        keep, reason = _budgeted(i, lambda: job.take([tok], None))
        if progress:
            progress(min(i + 1, n), n + 1)
        if reason is not None and i + keep == n:
            ended = reason
            break
        if reason is not None and i + keep < n:   # the engine's answer ends here
            at = i + keep
            return differs(at, f"the answer ends there ({_why(job, tok)}), but the receipt "
                           f"goes on with {info.describe(start + at - 1, out_ids[at])}",
                           info.get(start + at - 1, out_ids[at]), None)
        if i == n:   # the engine's answer goes on where the receipt's ended
            return differs(n, f"the receipt's answer ends there ({finish}), but the engine "
                           f"draws {info.describe(pos - 1, tok)}", None, info.get(pos - 1, tok))
    if progress:
        progress(n + 1, n + 1)
    ended = ended or "cancelled"
    if ended != finish:
        return Verification("differs", f"the {n} tokens are identical, but the answer ends by "
                            f"{ended}, not by {finish} as the receipt says", n_tokens=n,
                            position=n, **base)
    job.finish(ended, None)
    derived = "".join(d.text for d in deltas)
    if derived != text:
        return Verification("differs", f"the {n} tokens are identical, but their text is "
                            f"{_clip(derived)}, not {_clip(text)} as the receipt says",
                            n_tokens=n, **base)
    signed = f"signed by key {fingerprint(signed_by)}" if signed_by else "unsigned"
    return Verification("verified", f"verified: {n} tokens identical ({finish}; {signed})",
                        n_tokens=n, **base)


# a position's grammar work (its mask, then the token taken): the server's budget is
# MASK_BUDGET_SECONDS a step (engine/grammar_step.py); a verifier may be a slower machine
VERIFY_MASK_SECONDS = 10.0


def _budgeted(i: int, work: Callable[[], Any]) -> Any:
    from kinetic.engine.grammar_step import MASK_BUDGET_SECONDS
    from kinetic.grammar import MaskBudgetExceeded, mask_budget
    try:
        with mask_budget(VERIFY_MASK_SECONDS):
            return work()
    except MaskBudgetExceeded:
        raise ReceiptError(f"the request's grammar took more than {VERIFY_MASK_SECONDS:g} s at "
                           f"output position {i}, where kinetic serve allows "
                           f"{MASK_BUDGET_SECONDS:g} s a step") from None


def _why(job, tok: int) -> str:
    if job.stops.stopped is not None:
        return f"stop string {job.stops.stopped!r}"
    if tok < 0:
        return "no token allowed"
    if tok in job.tokenizer.eog_ids:
        return f"end-of-generation token {tok}"
    return "the grammar ends"


def _clip(s: str, n: int = 80) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


class _TokenInfo:
    """Tokens at a row of the scored logits: text and log-probability, as the API reports."""

    def __init__(self, engine, logits: np.ndarray):
        self.engine, self.logits = engine, logits

    def get(self, row: int, token: int) -> TokenInfo:
        (lp,) = self.engine.runner.sampler.token_logprobs(self.logits[row:row + 1], [token])
        tok = self.engine.tokenizer
        text = tok.token_piece(token, special=True) if 0 <= token < tok.vocab_size else ""
        return TokenInfo(int(token), text, lp)

    def describe(self, row: int, token: int) -> str:
        t = self.get(row, token)
        return f"token {t.token} {t.text!r} (logprob {t.logprob:.4f})"


def _sample_row(engine, job, row: np.ndarray, history: list[int], position: int,
                shape) -> tuple[int, float]:
    """One row sampled as the engine samples it inside any step (a row's draw does not depend
    on the rows beside it): its SampleRow from the job (sample_batch.sample_row: its token
    mask, bias and DRY pairs at the engine's fixed widths, penalty history, Mirostat state)
    drawn by the engine's runner (Runner.sample). Returns (token, mu)."""
    mask = None
    if job.matcher is not None:
        mask = np.zeros(shape.mask_words, np.int32)
        job.matcher.fill_mask(mask[:job.matcher.vocab.n_words])
    (batch,) = sample_batches([sample_row(job, 0, position, history, mask, shape)], shape)
    drawn = engine.runner.sample(row[None, :], batch)
    return drawn.tokens[0], drawn.mus[0]
