"""llama-server's slot actions and /apply-template.

POST /slots/{id}?action=save|restore|erase acts on the prompt cache of a slot's last request.
kinetic's prefix cache is shared by every slot and found by token ids (kinetic/engine/
kv_cache.py), so a slot's cache is the token ids of its last request (its prompt and the
answer's tokens that were run), and:

- save writes those ids to a file in --slot-save-path (a small JSON file; the K and V
  values are not written);
- restore reads the ids back and computes their whole pages into the prefix cache (the
  engine's prefill), so that a later prompt that starts with them reuses them, in any slot.
  Recomputing gives the same values a saved copy would hold: answers never depend on the
  cache, and the file stays valid across kinetic versions and KV cache types;
- erase drops the cached pages of those ids that no running request uses.

File names are bare names inside --slot-save-path (no directory parts, no leading dot);
without --slot-save-path, save and restore answer 501. The folder may be shared with other
local users (a folder under /tmp), so a name is only ever opened inside it, never through a
symbolic link: an existing name that is not a plain file of one name (a link, a folder, a
FIFO, a hard link) is a 400 naming it, a save writes a new file and renames it over the
name, and a restore parses at most MAX_FILE_BYTES nested at most MAX_FILE_DEPTH deep. Errors
name the file, never the folder's path.

POST /apply-template renders a conversation through the chat template, as a chat completion
would, and answers {"prompt": text} without running the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import secrets
import stat
import time

from quart import Blueprint, request

from kinetic.api.chat_reply import chat_text
from kinetic.api.body import nesting_depth
from kinetic.api.core import (ServerState, json_body, json_response, require_kind,
                              server_state)
from kinetic.api.errors import APIError, bad_request
from kinetic.api.offload import offload
from kinetic.api.params import parse_chat

blueprint = Blueprint("slot_actions", __name__)

FILE_FORMAT = "kinetic-slot-cache"
FILE_VERSION = 1
MAX_FILE_BYTES = 16 << 20                     # a restore reads at most this much
MAX_FILE_DEPTH = 4                            # and parses JSON nested at most this deep
NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,254}")


@blueprint.post("/slots/<int:id_slot>")
async def slot_action(id_slot: int):
    state = server_state()
    model = require_kind(state, "text", "slot actions")
    if not 0 <= id_slot < model.engine.config.parallel:
        raise bad_request(f"there is no slot {id_slot} (this server has "
                          f"{model.engine.config.parallel})", "id_slot")
    action = request.args.get("action", "")
    if action == "erase":
        tokens = _slot_tokens(state, id_slot)
        erased = await model.engine.forget(tokens)
        return json_response({"id_slot": id_slot, "n_erased": erased})
    if action not in ("save", "restore"):
        raise bad_request(f"action must be save, restore or erase, not {action!r}", "action")
    if state.config.slot_save_path is None:
        raise APIError(501, "This server does not support slots action. Start it with "
                       "`--slot-save-path`")
    body = await json_body() if await request.get_data() else {}
    name = _file_name(body.get("filename"))
    began = time.perf_counter()
    if action == "save":
        tokens = _slot_tokens(state, id_slot)
        written = await asyncio.to_thread(_write, name, state, tokens)
        return json_response({"id_slot": id_slot, "filename": name,
                              "n_saved": len(tokens), "n_written": written,
                              "timings": {"save_ms": 1e3 * (time.perf_counter() - began)}})
    tokens, read = await asyncio.to_thread(_read, name, state)
    if len(tokens) >= model.n_ctx:
        raise bad_request(f"the file holds {len(tokens)} tokens; a slot's context holds "
                          f"{model.n_ctx}", "filename")
    if tokens:
        result = await model.engine.submit_prefill(tokens)
        if result.error is not None:
            raise APIError(500, result.error)
    return json_response({"id_slot": id_slot, "filename": name,
                          "n_restored": len(tokens), "n_read": read,
                          "timings": {"restore_ms": 1e3 * (time.perf_counter() - began)}})


def _slot_tokens(state: ServerState, id_slot: int) -> list[int]:
    """The token ids a slot's last request left in the cache: its prompt and the answer's
    tokens but the last (drawn, never run). A request still running there: 409."""
    task = state.activity.last.get(id_slot)
    if task is None:
        return []
    if task.t_end is None:
        raise APIError(409, f"slot {id_slot} is processing a request; try again once it ends")
    return list(task.request.prompt) + task.output[:-1]


def _file_name(name) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise bad_request("filename must be a plain file name (letters, digits, '_', '-', "
                          "'.'; no directories, no leading dot)", "filename")
    return name


def _save_dir(state: ServerState) -> int:
    """A descriptor of --slot-save-path: every file is opened relative to it, by its bare
    name, so the folder is looked up once and a name never resolves elsewhere."""
    try:
        return os.open(state.config.slot_save_path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise APIError(500, f"the slot save folder cannot be opened ({e.strerror or e})") \
            from None


def _check_regular(st: os.stat_result, name: str) -> None:
    """400 unless `st` (not following a link) is a plain file with no other name: a symbolic
    link, a folder, a FIFO or a device is refused, and so is a hard link, which another
    local user could have made to a file outside the folder."""
    if stat.S_ISLNK(st.st_mode):
        raise bad_request(f"{name} is a symbolic link in the slot save folder; slot files "
                          f"must be plain files", "filename")
    if not stat.S_ISREG(st.st_mode):
        raise bad_request(f"{name} is not a plain file in the slot save folder", "filename")
    if st.st_nlink > 1:
        raise bad_request(f"{name} has other names (hard links); slot files must be plain "
                          f"files", "filename")


def _write(name: str, state: ServerState, tokens: list[int]) -> int:
    """Write the slot file `name`: into a new file of the folder, renamed over `name` once
    complete, so that nothing outside the folder is ever opened for writing (a rename
    replaces a link; it never writes through one) and a reader never sees half a file. A
    `name` that exists must be a plain file (_check_regular)."""
    data = json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION,
                       "model": os.path.basename(state.require_model().loaded.file.path),
                       "vocab_size": state.require_model().config.vocab_size,
                       "tokens": tokens}).encode()
    folder = _save_dir(state)
    temp = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        try:
            _check_regular(os.stat(name, dir_fd=folder, follow_symlinks=False), name)
        except FileNotFoundError:
            pass
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=folder)
            raise
    except OSError as e:
        raise APIError(500, f"cannot write {name}: {e.strerror or 'error'}") from None
    finally:
        os.close(folder)
    return len(data)


def _read(name: str, state: ServerState) -> tuple[list[int], int]:
    """The token ids of the slot file `name`, opened without following a link and without
    blocking (a FIFO), then checked to be a plain file (_check_regular) of at most
    MAX_FILE_BYTES, nested at most MAX_FILE_DEPTH deep."""
    folder = _save_dir(state)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except FileNotFoundError:
        raise bad_request(f"no slot file {name!r} in the save path", "filename") from None
    except OSError as e:
        if e.errno == errno.ELOOP:   # O_NOFOLLOW met a link
            raise bad_request(f"{name} is a symbolic link in the slot save folder; slot files "
                              f"must be plain files", "filename") from None
        raise APIError(500, f"cannot read {name}: {e.strerror or 'error'}") from None
    finally:
        os.close(folder)
    try:
        try:
            _check_regular(os.fstat(fd), name)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise APIError(500, f"cannot read {name}: {e.strerror or 'error'}") from None
    if len(data) > MAX_FILE_BYTES:
        raise bad_request(f"{name} is larger than {MAX_FILE_BYTES} bytes", "filename")
    saved = None
    if data.count(b"[") + data.count(b"{") <= MAX_FILE_DEPTH or \
            nesting_depth(data) <= MAX_FILE_DEPTH:   # never a RecursionError in the parser
        try:
            saved = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            pass
    if not isinstance(saved, dict) or saved.get("format") != FILE_FORMAT:
        raise bad_request(f"{name} is not a slot file kinetic wrote", "filename")
    if saved.get("version") != FILE_VERSION:
        raise bad_request(f"{name} has version {saved.get('version')!r}; this kinetic reads "
                          f"version {FILE_VERSION}", "filename")
    vocab = state.require_model().config.vocab_size
    tokens = saved.get("tokens")
    if saved.get("vocab_size") != vocab or not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise bad_request(f"{name} was saved from a model with another vocabulary", "filename")
    return tokens, len(data)


@blueprint.post("/apply-template")
async def apply_template():
    """The conversation as the chat template renders it for a chat completion."""
    state = server_state()
    model = require_kind(state, "text", "chat templates")
    req = await offload(parse_chat, await json_body(), model.default_params, model.text_tokens)
    return json_response({"prompt": await offload(chat_text, model, req)})
