"""A receipt's parts and how they are made: the canonical form, the model file's hash, the
engine's settings, the grammar's source, the request as the engine ran it (and back), and
ReceiptMaker, which puts them together with an answer's output (kinetic/receipts/__init__.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import weakref
from typing import Any

from kinetic import __version__

RECEIPT_VERSION = 1
# SamplingParams fields that are not sampling: what the answer reports, not what it draws
_NOT_SAMPLING = ("seed", "logprobs", "top_logprobs")


class ReceiptError(ValueError):
    """A receipt that cannot be checked (the message says why), or a key that cannot be used."""


# --- the canonical form ---------------------------------------------------------------------

def canonical(obj: Any) -> bytes:
    """The receipt's byte form, what a signature covers: JSON with sorted keys, no spaces,
    UTF-8, no NaN or infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _json_text(obj: Any) -> str:
    """JSON text that keeps `obj`'s key order (a schema's property order shapes its grammar)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# --- the model file -------------------------------------------------------------------------

_hashes: dict[tuple[str, int, int], str] = {}
_hash_lock = threading.Lock()


def model_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """{"name", "size", "sha256"} of a model file. The hash is computed once per file: kept
    in memory and in a record (kinetic.fetch.digest_record: beside a file of kinetic's model
    cache, else under its `digests/` folder), both keyed by the path, size and mtime, so a
    changed file is hashed again. Blocking the first time (a
    large file takes seconds): the server calls it from a worker thread."""
    from kinetic.fetch import file_sha256
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_size, st.st_mtime_ns)
    with _hash_lock:
        digest = _hashes.get(key)
        if digest is None:
            digest = _hashes[key] = file_sha256(real)
    return {"name": os.path.basename(os.fspath(path)), "size": st.st_size, "sha256": digest}


# --- the engine -----------------------------------------------------------------------------

def _weights(loaded) -> tuple[str, str]:
    """(how the weights are held, how activations are rounded before each projection)."""
    from kinetic.model.layers import DENSE, Proj
    if loaded.config.kernel == "ffi":
        return "gguf", "llama.cpp"   # the C++ kernel reads the blocks, rounds as llama.cpp
    if loaded.config.kernel == "pallas":
        return "gguf", "none"        # the blocks' values, activations in float32
    projs = [v for blk in loaded.weights["blk"] for v in blk.values() if isinstance(v, Proj)]
    dense = [p for p in projs if p.fmt == DENSE]
    dtype = str(dense[0].data.dtype) if dense else "float32"
    return dtype, "llama.cpp" if any(p.act_quant for p in dense) else "none"


def engine_record(engine) -> dict[str, Any]:
    """What decides the bits of `engine`'s answers (docs/architecture.md, the determinism
    contract)."""
    import jax

    from kinetic import kernels
    kernel = engine.model.config.kernel
    weights, rounding = _weights(engine.model)
    out = {
        "name": "kinetic", "version": __version__, "jax": jax.__version__,
        "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
        "kernel": kernel, "weights": weights, "activation_rounding": rounding,
        "step_tokens": engine.config.step_tokens, "row_buckets": list(engine.runner.row_buckets),
        "sample_buckets": list(engine.sample_shape.buckets), "n_ctx": engine.max_context,
        "page_size": engine.config.page_size, "kv_dtype": engine.config.kv_dtype,
        "max_candidates": engine.sample_shape.max_candidates,
        "history_width": engine.sample_shape.history_width,
        # for the record: a split gives the same bits (engine/split.py)
        "split": engine.runner.split,
    }
    if kernel == "ffi":
        out["kernel_isa"] = kernels.isa()   # every path gives the same bits: for the record
    return out


# --- the grammar ----------------------------------------------------------------------------

_digests: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def grammar_digest(grammar) -> str:
    """SHA-256 of a compiled grammar's tables (what its matcher follows; rule names aside)."""
    digest = _digests.get(grammar)
    if digest is None:
        h = hashlib.sha256()
        h.update(f"{grammar.root},{len(grammar.kind)};".encode())
        h.update(bytes(grammar.kind))
        h.update(b"".join(a.to_bytes(32, "little") for a in grammar.arg))
        h.update(";".join(",".join(map(str, s)) for s in grammar.starts).encode())
        digest = _digests[grammar] = h.hexdigest()
    return digest


def grammar_record(grammar) -> dict[str, Any]:
    """What `grammar` was compiled from (Grammar.source) and its digest. A grammar built
    otherwise is recorded as its compiled rules. JSON Schemas and tools are kept as JSON text,
    in their own key order: a canonical form sorts keys, and property order shapes the grammar."""
    src = grammar.source or {}
    rec: dict[str, Any] = {"sha256": grammar_digest(grammar)}
    try:
        if src.get("type") == "gbnf":
            return dict(rec, type="gbnf", gbnf=src["gbnf"])
        if src.get("type") == "json_schema":
            return dict(rec, type="json_schema", schema=_json_text(src["schema"]))
        if src.get("type") == "tool_call":
            return dict(rec, type="tool_call", format=src["format"],
                        tools=_json_text(src["tools"]), parallel=bool(src["parallel"]),
                        think=src["think"])
    except (TypeError, ValueError):   # a schema of Python objects JSON cannot write
        pass
    return dict(rec, type="rules", rules=_json_text(_lowered(grammar)))


def _lowered(grammar) -> dict[str, Any]:
    from kinetic.grammar.ir import END, TERM
    rules = []
    for starts in grammar.starts:
        alts = []
        for p in starts:
            syms = []
            while grammar.kind[p] != END:
                k, a = grammar.kind[p], grammar.arg[p]
                syms.append([k, format(a, "x") if k == TERM else a])
                p += 1
            alts.append(syms)
        rules.append(alts)
    return {"root": grammar.root, "names": grammar.rule_names, "rules": rules}


def compile_grammar(rec: dict[str, Any]):
    """The Grammar of a receipt's `request.grammar`, compiled again here. Raises ReceiptError
    if it cannot be, or if it compiles to other tables than the answer followed."""
    from kinetic.chat.tool_calls import FORMATS
    from kinetic.grammar import compile_gbnf, compile_json_schema
    from kinetic.grammar.ir import TERM, checked_grammar
    if not isinstance(rec, dict):
        raise ReceiptError("request.grammar must be null or an object")
    kind = rec.get("type")
    try:
        if kind == "gbnf":
            grammar = compile_gbnf(_need(rec, "gbnf", str, "request.grammar"))
        elif kind == "json_schema":
            grammar = compile_json_schema(json.loads(_need(rec, "schema", str, "request.grammar")))
        elif kind == "tool_call":
            fmt = FORMATS.get(rec.get("format"))
            if fmt is None:
                raise ReceiptError(f"request.grammar: unknown tool-call format "
                                   f"{rec.get('format')!r}")
            grammar = fmt.grammar(json.loads(_need(rec, "tools", str, "request.grammar")),
                                  bool(rec.get("parallel")), rec.get("think"))
        elif kind == "rules":
            # tables, not a source: checked as a compiler would check its own (shape, size,
            # left recursion), since a crafted table can make the matcher's work endless
            low = json.loads(_need(rec, "rules", str, "request.grammar"))
            rules = [[[[k, int(a, 16) if k == TERM and isinstance(a, str) else a]
                       for k, a in alt] for alt in alts] for alts in low["rules"]]
            grammar = checked_grammar(low["names"], rules, low["root"])
        else:
            raise ReceiptError(f"request.grammar has an unknown type {kind!r}")
    except ReceiptError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise ReceiptError(f"request.grammar does not compile: {e}") from None
    if grammar_digest(grammar) != rec.get("sha256"):
        raise ReceiptError("request.grammar compiles here to other tables than the answer "
                           "followed (its sha256 differs): another kinetic version made it?")
    return grammar


# --- the request ----------------------------------------------------------------------------

def request_record(request, seed: int, grammar: dict[str, Any] | None) -> dict[str, Any]:
    """A GenerationRequest as the engine ran it: prompt ids, every sampling field (seed: the
    one used), the grammar record, stop strings, max_tokens, special_text."""
    p = request.params
    out: dict[str, Any] = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)
                           if f.name not in _NOT_SAMPLING}
    # -inf and -100 both ban a token (sampling_params.bias_pairs); JSON has no -inf
    out["logit_bias"] = [[t, max(b, -100.0)] for t, b in p.logit_bias]
    out["dry_sequence_breakers"] = list(p.dry_sequence_breakers)
    out.update(prompt_ids=list(request.prompt), seed=int(seed), max_tokens=request.max_tokens,
               stop=list(request.stop), grammar=grammar, special_text=bool(request.special_text))
    return out


def _rebuild_request(rec: dict[str, Any]):
    """(GenerationRequest, seed) from a receipt's `request`; ReceiptError if it is not one."""
    from kinetic.engine.request import GenerationRequest
    from kinetic.engine.sampling_params import SamplingParams
    prompt = _need(rec, "prompt_ids", list, "request")
    if not prompt or not all(_is_int(t) for t in prompt):
        raise ReceiptError("request.prompt_ids must be a non-empty list of token ids")
    seed = _need(rec, "seed", int, "request")
    names = [f.name for f in dataclasses.fields(SamplingParams) if f.name not in _NOT_SAMPLING]
    missing = [n for n in names if n not in rec]
    if missing:
        raise ReceiptError(f"the receipt has no request.{missing[0]}")
    values = {n: rec[n] for n in names}
    try:
        values["logit_bias"] = tuple(tuple(pair) for pair in values["logit_bias"])
        values["dry_sequence_breakers"] = tuple(values["dry_sequence_breakers"])
        params = SamplingParams(**values, seed=seed)
        grammar = compile_grammar(rec["grammar"]) if rec.get("grammar") is not None else None
        stop = tuple(_need(rec, "stop", list, "request"))
        max_tokens = rec.get("max_tokens")
        if not all(isinstance(s, str) for s in stop) or not (
                max_tokens is None or _is_int(max_tokens)):
            raise ReceiptError("request.stop must be a list of strings and request.max_tokens "
                               "an integer or null")
        request = GenerationRequest(list(prompt), params, max_tokens, stop,
                                    speculative=False, grammar=grammar,
                                    special_text=bool(rec.get("special_text")))
    except ReceiptError:
        raise
    except (TypeError, ValueError) as e:
        raise ReceiptError(f"the receipt's request is not one kinetic runs: {e}") from None
    return request, seed


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(obj: Any, key: str, kind: type, where: str) -> Any:
    value = obj.get(key) if isinstance(obj, dict) else None
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise ReceiptError(f"the receipt's {where}.{key} is missing or not "
                           f"{'an integer' if kind is int else 'a ' + kind.__name__}")
    return value


# --- making one -----------------------------------------------------------------------------

class ReceiptMaker:
    """The receipt of one request's answer: made before the request runs (the model's hash
    and the grammar's digest are computed here, blocking the first time: call it from a
    worker thread in a server), fed the answer's deltas, then `receipt()`."""

    def __init__(self, engine, request, signer=None,
                 model_file: str | None = None):
        self.engine, self.request, self.signer = engine, request, signer
        self.model = model_record(model_file or engine.model.file.path)
        self.grammar = grammar_record(request.grammar) if request.grammar is not None else None
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.seed: int | None = None
        self.finish_reason: str | None = None

    def feed(self, delta) -> None:
        self.token_ids.extend(int(t) for t in delta.token_ids)
        self.text.append(delta.text)
        if delta.usage is not None:
            self.seed = delta.usage.seed
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def receipt(self) -> dict[str, Any]:
        """The receipt (signed with the signer, if any), once the last delta was fed."""
        if self.seed is None or self.finish_reason is None:
            raise RuntimeError("the answer has not finished: no receipt yet")
        body = {
            "version": RECEIPT_VERSION, "model": self.model,
            "engine": engine_record(self.engine),
            "request": request_record(self.request, self.seed, self.grammar),
            "output": {"token_ids": self.token_ids, "text": "".join(self.text),
                       "finish_reason": self.finish_reason},
        }
        return self.signer.sign(body) if self.signer is not None else body
