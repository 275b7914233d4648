"""Hot-swap LoRA adapters into a running vLLM server under versioned names.

1. An adapter is loaded under a new name (`policy-r3-...`), never reloaded in place: vLLM may
   reuse stale prefix-cache entries for a reused name.
2. Only a complete checkpoint (with its marker) is loaded; a load is confirmed by `/v1/models`
   and a canary generation under the new name.
3. If the load request fails in transit, `/v1/models` decides whether it registered, so a retry
   never double-registers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
from safetensors import safe_open

from memory import folders
from serving import access, probe
from serving.errors import ServingError

log = logging.getLogger(__name__)

TIMEOUT_S = 60.0


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def validate_adapter(
    path: Path, *, root: Path, max_rank: int, base_modules: set[str] | None = None
) -> Path:
    """Check an adapter before any server sees it; returns its resolved path.

    Refused: a path outside `root` (after resolving `..` and symlinks), a missing folder or
    marker, an unreadable config, a rank over the server's limit, truncated weights, and weights
    that bind no module of the base model (`base_modules`, module names without `.weight`).
    """
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ServingError(f"adapter path {path} is outside the checkpoint root")
    if not resolved.is_dir():
        raise ServingError(f"adapter folder {path} not found")
    if not folders.is_complete(resolved):
        raise ServingError(f"adapter {path} is not a complete checkpoint")
    rank = _adapter_rank(resolved)
    if rank > max_rank:
        raise ServingError(f"adapter {path} has rank {rank}, over the server's limit {max_rank}")
    modules = _adapter_modules(resolved)
    missing = modules - base_modules if base_modules is not None else set()
    if missing == modules:
        raise ServingError(f"adapter {path} binds no module of the base model")
    if missing:
        example = sorted(missing)[0]
        raise ServingError(
            f"adapter {path} binds {len(missing)} modules the base model lacks, e.g. {example}"
        )
    return resolved


def base_model_modules(model_path: Path) -> set[str]:
    """Names of the base model's weight-bearing modules, read from its safetensors headers."""
    names: set[str] = set()
    for file in model_path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as weights:
            names |= {key.removesuffix(".weight") for key in weights.keys()}  # noqa: SIM118
    return names


def _adapter_rank(path: Path) -> int:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        return int(config["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ServingError(f"adapter {path} has no readable {ADAPTER_CONFIG}") from exc


def _adapter_modules(path: Path) -> set[str]:
    """Module names the LoRA weights attach to, e.g. `model.layers.0.self_attn.q_proj`."""
    try:
        with safe_open(path / ADAPTER_WEIGHTS, framework="pt") as weights:
            keys = list(weights.keys())  # noqa: SIM118
            for key in keys:
                weights.get_slice(key)[:1]  # touches the data: a truncated file fails here
    except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types
        raise ServingError(f"adapter {path} has unreadable weights: {exc}") from exc
    modules = set()
    for key in keys:
        name = key.removeprefix("base_model.model.")
        for marker in (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B"):
            if marker in name:
                modules.add(name.split(marker)[0])
    if not modules:
        raise ServingError(f"adapter {path} holds no LoRA weights")
    return modules


def loaded_models(url: str) -> list[str]:
    """The model names `url` serves; `ServingError` for an answer that is not a model list."""
    with httpx.Client(base_url=url, timeout=TIMEOUT_S, headers=access.headers()) as client:
        response = client.get("/v1/models")
        response.raise_for_status()
    try:
        return [str(entry["id"]) for entry in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ServingError(f"{url}/v1/models is not a model list: {response.text[:100]!r}") from exc


def load_adapter(url: str, name: str, path: Path) -> None:
    """Load `path` as `name` and prove it answers; raises `ServingError` otherwise."""
    if not folders.is_complete(path):
        raise ServingError(f"adapter {path} is not a complete checkpoint")
    if name in loaded_models(url):
        raise ServingError(f"adapter name {name!r} is already loaded; names must be new")
    body = {"lora_name": name, "lora_path": str(path.resolve())}
    with httpx.Client(base_url=url, timeout=TIMEOUT_S, headers=access.headers()) as client:
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
    with httpx.Client(base_url=url, timeout=TIMEOUT_S, headers=access.headers()) as client:
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": name})
    if response.status_code != 200:
        raise ServingError(f"could not unload {name!r} ({response.status_code})")


def canary(client: httpx.Client, model: str) -> str:
    """A probe under `model`; its text, or `ServingError`."""
    found = probe.generation(client, model)
    if not found.ok:
        raise ServingError(f"canary for {model!r} failed: {found.reason}")
    return found.text
