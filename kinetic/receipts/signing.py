"""Signing receipts: Ed25519 (the cryptography package) over the canonical form of the rest."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

from kinetic.receipts.record import ReceiptError, canonical

SIGNATURE_ALG = "ed25519"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class Signer:
    """An Ed25519 private key that signs receipts."""

    def __init__(self, key):
        from cryptography.hazmat.primitives import serialization
        self._key = key
        self.public_key = _b64(key.public_key().public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw))

    def sign(self, receipt: dict[str, Any]) -> dict[str, Any]:
        """`receipt` with a `signature` over the canonical form of the rest."""
        body = {k: v for k, v in receipt.items() if k != "signature"}
        value = self._key.sign(canonical(body))
        return dict(body, signature={"alg": SIGNATURE_ALG, "public_key": self.public_key,
                                     "value": _b64(value)})


def load_signing_key(path: str | os.PathLike[str]) -> Signer:
    """The Signer of a PEM (PKCS#8) Ed25519 private key file. Raises ReceiptError with one
    line saying what is wrong: missing, unreadable, not PEM, encrypted, another key type."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ReceiptError("no such file") from None
    except OSError as e:
        raise ReceiptError(f"cannot read it: {e.strerror or e}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise ReceiptError("the key is encrypted; give an unencrypted PKCS#8 key "
                           "(kinetic keygen FILE writes one)") from None
    except Exception as e:  # noqa: BLE001 - ValueError, or another by cryptography's version
        raise ReceiptError(f"not a PEM private key ({type(e).__name__}); kinetic keygen FILE "
                           f"writes one") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ReceiptError(f"a {type(key).__name__.lstrip('_')}, not an Ed25519 key; "
                           f"kinetic keygen FILE writes one")
    return Signer(key)


def write_signing_key(path: str | os.PathLike[str], force: bool = False) -> str:
    """Write a new Ed25519 private key to `path` as PEM PKCS#8, readable by its owner only
    (0600); returns its public key (base64 of the raw 32 bytes). An existing file is kept
    (FileExistsError) unless `force`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    if force:
        Path(path).unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return Signer(key).public_key


def parse_public_key(value: str) -> bytes:
    """The raw 32 bytes of an Ed25519 public key given as base64 (what keygen prints), or as a
    file holding that, a PEM public key, or the PEM private key itself. Raises ReceiptError."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (Ed25519PrivateKey,
                                                                   Ed25519PublicKey)
    text = value
    if os.path.isfile(value):
        try:
            text = Path(value).read_text(errors="replace")
        except OSError as e:
            raise ReceiptError(f"--public-key {value}: cannot read it: {e.strerror or e}") \
                from None
    text = text.strip()
    if text.startswith("-----BEGIN"):
        try:
            key = (serialization.load_pem_private_key(text.encode(), password=None)
                   if "PRIVATE KEY" in text.split("\n", 1)[0]
                   else serialization.load_pem_public_key(text.encode()))
        except Exception as e:  # noqa: BLE001
            raise ReceiptError(f"--public-key: not a PEM key ({type(e).__name__})") from None
        if isinstance(key, Ed25519PrivateKey):
            key = key.public_key()
        if not isinstance(key, Ed25519PublicKey):
            raise ReceiptError("--public-key: not an Ed25519 key")
        return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    raw = _unb64(text)
    if raw is None or len(raw) != 32:
        # no key: a path to none, said so (base64 has "/" too, so only here)
        if os.path.isdir(value):
            raise ReceiptError(f"--public-key {value}: a folder, not a key file")
        if os.sep in value and not os.path.exists(value):
            raise ReceiptError(f"--public-key {value}: no such file")
        raise ReceiptError("--public-key: not an Ed25519 public key (base64 of 32 bytes, as "
                           "kinetic keygen prints it, or a PEM file)")
    return raw


def fingerprint(public_key: str | bytes) -> str:
    """A public key's fingerprint, as OpenSSH writes one: "SHA256:" and the unpadded base64 of
    the SHA-256 of its raw 32 bytes (`public_key`: those bytes, or their base64)."""
    raw = public_key if isinstance(public_key, bytes) else base64.b64decode(public_key)
    return "SHA256:" + base64.b64encode(hashlib.sha256(raw).digest()).decode().rstrip("=")


def _unb64(text: Any) -> bytes | None:
    if not isinstance(text, str):
        return None
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return None


class Tampered(ReceiptError):
    """A well-formed signature that does not hold over the receipt's content: something was
    changed after signing (the verifier still re-runs it, to name what)."""


def check_signature(receipt: dict[str, Any], public_key: bytes | None = None) -> str | None:
    """The signer's public key (base64) if the receipt is signed and its signature holds over
    the rest, None if it is unsigned (and no `public_key` is asked for). Raises ReceiptError for
    a bad signature, one by another key than `public_key`, or no signature when one is asked."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    sig = receipt.get("signature")
    if sig is None:
        if public_key is not None:
            raise ReceiptError("the receipt is not signed, and --public-key asks for a signer")
        return None
    if not isinstance(sig, dict) or sig.get("alg") != SIGNATURE_ALG:
        raise ReceiptError(f"bad signature: signature.alg must be {SIGNATURE_ALG!r}")
    key, value = _unb64(sig.get("public_key")), _unb64(sig.get("value"))
    if key is None or len(key) != 32 or value is None or len(value) != 64:
        raise ReceiptError("bad signature: signature.public_key and value must be base64 of "
                           "32 and 64 bytes")
    if public_key is not None and key != public_key:   # before the signature: no re-run
        raise ReceiptError(f"signed by another key ({sig['public_key']}), not by "
                           f"{_b64(public_key)}")
    body = {k: v for k, v in receipt.items() if k != "signature"}
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(value, canonical(body))
    except InvalidSignature:
        raise Tampered("bad signature: the receipt is not what its signer signed (changed "
                       "after signing?)") from None
    except ValueError as e:   # canonical() of a body with NaN, say
        raise ReceiptError(f"bad signature: {e}") from None
    return sig["public_key"]
