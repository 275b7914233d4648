"""The model servers' own key: vLLM answers its inference and adapter routes (`/v1`) only to
callers that send it, so the gateway, the workers and the flows are the only way in.

1. The key is `FLYWHEEL_SERVER_KEY`. A command that starts a model server without one makes one
   (`ensure_key`) and sets it in its own environment, which every process it starts inherits
   (the gateway, workers, Prefect flow runs). A worker or gateway on another machine needs the
   same variable; `flywheel serve-model` prints where to find it.
2. The server gets the key as `VLLM_API_KEY`, never on its command line (which any local user
   can read); each client sends it as a bearer token (`headers`).
3. vLLM guards only `/v1`: `/health`, `/metrics`, `/tokenize` and the dev routes of merged
   weights stay open, which is why model servers listen on loopback only.
"""

from __future__ import annotations

import os
import secrets

ENV = "FLYWHEEL_SERVER_KEY"


def key() -> str | None:
    """The model servers' key in this environment, if any."""
    return os.environ.get(ENV) or None


def bearer(found: str | None) -> dict[str, str]:
    """The header a client sends with `found` as its key (none without one)."""
    return {"Authorization": f"Bearer {found}"} if found else {}


def ensure_key() -> str:
    """The key, made (and set in this process's environment, for its children) if missing."""
    found = key()
    if found is None:
        found = os.environ[ENV] = secrets.token_urlsafe(32)
    return found


def headers() -> dict[str, str]:
    """What a client of a model server sends: the key as a bearer token, when there is one."""
    return bearer(key())
