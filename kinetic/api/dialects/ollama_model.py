"""The loaded model described in Ollama's words, for /api/tags, /api/ps and /api/show
(kinetic/api/dialects/ollama.py): its listing (name:latest, size, sha256 digest, details),
its parameter count and quantization as Ollama writes them (8B, Q4_K_M), its capabilities and
its metadata as model_info.
"""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timezone
from typing import Any

import numpy as np

from kinetic.api.core import ServerState
from kinetic.chat.reasoning import template_knows_thinking
from kinetic.receipts.record import model_record


def file_time(path: str) -> str:
    """A file's modification time as Ollama writes times (UTC, ISO 8601, Z)."""
    mtime = os.stat(path).st_mtime
    return datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it: 8B, 1.5B, 494.03M, 135K."""
    for size, suffix, digits in ((10**9, "B", 1), (10**6, "M", 2), (10**3, "K", 0)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{suffix}" if value == int(value) else f"{value:.{digits}f}{suffix}"
    return str(n)


def quantization_level(gguf) -> str:
    """The file's quantization as Ollama names it (Q4_K_M, F16): general.file_type, else the
    type that holds most of the weights' bytes."""
    from gguf import LlamaFileType
    file_type = gguf.metadata.get("general.file_type")
    try:
        name = LlamaFileType(file_type).name
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        pass
    size: dict[str, int] = {}
    for t in gguf.tensors.values():
        size[t.qtype.name] = size.get(t.qtype.name, 0) + t.data.nbytes
    return max(size, key=size.get) if size else "unknown"


def parameter_count(gguf) -> int:
    return sum(int(np.prod(t.shape)) for t in gguf.tensors.values())


def details(state: ServerState) -> dict[str, Any]:
    gguf = state.require_model().loaded.file
    arch = gguf.architecture
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": human_number(parameter_count(gguf)),
            "quantization_level": quantization_level(gguf)}


def listed_name(state: ServerState) -> str:
    """The model's name in /api/tags and /api/ps, with Ollama's tag (name:latest)."""
    return state.model_id if ":" in state.model_id else f"{state.model_id}:latest"


def capabilities(state: ServerState) -> list[str]:
    """What the model does, in Ollama's words: "vision" with a projector (--mmproj); never
    "insert" (a suffix is refused)."""
    model = state.require_model()
    if state.kind != "text":
        return ["embedding"] if state.kind == "embedding" else []
    caps = ["completion"]
    template = model.chat_template
    if template.supports_tools:
        caps.append("tools")
    if template.supports_thinking or template_knows_thinking(template.source):
        caps.append("thinking")
    if model.projector is not None:
        caps.append("vision")
    return caps


async def listing(state: ServerState) -> dict[str, Any]:
    """The model as /api/tags and /api/ps list it."""
    path = state.require_model().loaded.file.path
    record = await asyncio.to_thread(model_record, path)   # hashed once, off the event loop
    name = listed_name(state)
    return {"name": name, "model": name, "modified_at": file_time(path),
            "size": record["size"], "digest": record["sha256"], "details": details(state)}


def model_info(gguf, verbose: bool) -> dict[str, Any]:
    """/api/show's model_info: the GGUF metadata but the chat template, as JSON values (lists
    as null unless `verbose`), with general.parameter_count. The arrays the loaded model
    dropped (GGUFFile.drop: the vocabulary's merges, scores, token types) are read from the
    file again for `verbose`, and are null without it, as every list is."""
    info: dict[str, Any] = {}
    for key in gguf.keys():
        if key == "tokenizer.chat_template":
            continue
        value = gguf.read(key) if verbose else gguf.metadata.get(key)
        if isinstance(value, (list, tuple, np.ndarray)):
            value = _json_value(value) if verbose else None
        info[key] = _json_value(value)
    info.setdefault("general.parameter_count", parameter_count(gguf))
    return info


def _json_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    return value
