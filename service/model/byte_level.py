"""The byte-level alphabet of GPT-2-style tokenizers: one printable character stands for each byte
(a token "Ġthe" is the bytes b" the"). The built-in tokenizers are written in it and the
detokenizer reads tokens back through it."""

from __future__ import annotations


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order: the characters of byte-level
    tokens (a token "Ġthe" is the bytes b" the")."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


BYTE_CHARS = _byte_chars()
