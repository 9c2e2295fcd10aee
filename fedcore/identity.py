"""Client identities: one alphabet and length everywhere (configs, joins, certificates, enrolled keys, logs).

A client id is 1-64 characters of ``A-Z a-z 0-9 . _ -`` starting with a letter or digit: it fits an X.509
common name (at most 64 characters), a file name and a log line, and cannot smuggle separators, control
characters or markup. Anything a client sends is shown in logs only through :func:`shorten`.
"""

from __future__ import annotations

import re

MAX_CLIENT_ID = 64
_CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
CLIENT_ID_RULE = f"1-{MAX_CLIENT_ID} characters of A-Z a-z 0-9 . _ - starting with a letter or digit"


def valid_client_id(value: str) -> bool:
    return _CLIENT_ID.fullmatch(value) is not None


def shorten(value: str, limit: int = 64) -> str:
    """A client-supplied string made safe to log: printable ASCII only, at most ``limit`` characters shown."""
    head = "".join(ch if " " <= ch <= "~" else "?" for ch in value[:limit])
    return head if len(value) <= limit else f"{head}...(+{len(value) - limit} chars)"
