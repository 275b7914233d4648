"""Hot-swap LoRA adapters into a running vLLM server under versioned names.

1. An adapter is loaded under a new name (`policy-r3-...`), never reloaded in place: vLLM may
   reuse stale prefix-cache entries for a reused name.
2. Only a complete checkpoint (with its marker) is loaded; a load is confirmed by `/v1/models`
   and a canary generation under the new name.
3. If the load request fails in transit, `/v1/models` decides whether it registered, so a retry
   never double-registers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import httpx

from serving.errors import ServingError

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
TIMEOUT_S = 60.0


def loaded_models(url: str) -> list[str]:
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        response = client.get("/v1/models")
        response.raise_for_status()
        return [entry["id"] for entry in response.json()["data"]]


def load_adapter(url: str, name: str, path: Path) -> None:
    """Load `path` as `name` and prove it answers; raises `ServingError` otherwise."""
    if not (path / MARKER).is_file():
        raise ServingError(f"adapter {path} is not a complete checkpoint")
    if name in loaded_models(url):
        raise ServingError(f"adapter name {name!r} is already loaded; names must be new")
    body = {"lora_name": name, "lora_path": str(path.resolve())}
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        try:
            response = client.post("/v1/load_lora_adapter", json=body)
        except httpx.TransportError:
            response = None
        if response is None and name not in loaded_models(url):
            raise ServingError(f"adapter {name!r}: load request failed and it is not registered")
        if response is not None and response.status_code != 200:
            raise ServingError(
                f"adapter {name!r} rejected ({response.status_code}): {response.text.strip()[:200]}"
            )
        canary(client, name)
    log.info("adapter %s loaded from %s", name, path)


def ensure_loaded(url: str, name: str, path: Path) -> bool:
    """Serve `name` from `path` unless the server already has it (e.g. after a restart).

    Returns whether a load happened."""
    if name in loaded_models(url):
        return False
    load_adapter(url, name, path)
    return True


def unload_adapter(url: str, name: str) -> None:
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    if response.status_code != 200:
        raise ServingError(f"could not unload {name!r} ({response.status_code})")


def canary(client: httpx.Client, model: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    response = client.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise ServingError(f"canary for {model!r} failed ({response.status_code})")
    choices = response.json().get("choices") or []
    if not choices:
        raise ServingError(f"canary for {model!r} returned no choices")
    return choices[0]["message"]["content"] or ""
