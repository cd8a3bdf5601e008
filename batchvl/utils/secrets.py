"""Secrets a job file may hold where batchvl writes or prints it: the user info of a URL
(`http://user:pass@host/v1`) and the values of secret-looking command-line arguments (`--api-key KEY`).
What is stored or shown keeps the rest, so that it still says which server and which command."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

MASK = "<not recorded>"
# A flag whose value is a secret, by how its name ends: --api-key, --hf-token, --password, --client-secret
# (not --tokenizer, --max-num-batched-tokens or --ssl-keyfile, whose values say how the server runs)
_SECRET_FLAG = re.compile(r"^--?[\w-]*(key|token|secret|password|passwd|credentials?)$", re.IGNORECASE)


def url_without_userinfo(url: str) -> str:
    """`url` without its `user:password@`, the rest as written."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def masked_args(args: list[str]) -> list[str]:
    """`args` with the value of each secret-looking flag masked (`--api-key KEY`, `--api-key=KEY`)."""
    masked, hide_next = [], False
    for arg in args:
        flag, equals, _ = arg.partition("=")
        if hide_next:
            masked.append(MASK)
            hide_next = False
        elif _SECRET_FLAG.match(flag) and equals:
            masked.append(f"{flag}={MASK}")
        else:
            masked.append(arg)
            hide_next = bool(_SECRET_FLAG.match(arg))
    return masked
