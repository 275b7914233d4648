"""Merged weights, reloaded in place: a new version served at the base model's full speed.

vLLM's CPU backend has no LoRA kernel, so a LoRA version samples several times slower than the
base model. A merged version (the adapter folded into the base weights, published by the
trainer as a full model folder) is served by the plain model path instead:

1. Before any server sees a folder, `check_folder` compares it with the base model: the same
   tensor names, shapes and dtypes, every value finite, published complete.
2. `swap` (vLLM's dev-mode routes, bound to loopback and never forwarded by the gateway): pause
   (new requests wait, running ones finish), `reload_weights` through `collective_rpc`, reset
   the prefix cache (its success is required: cached blocks came from the old weights), set the
   version label, resume; then the served model's log-probabilities of the trainer's own greedy
   continuations (`reference.json`) must match the trainer's within a tolerance, or the swap
   fails. A check on log-probabilities, not on sampled text, is exact where greedy text is not
   (near-ties flip with batch composition).
3. `serve` checks, then swaps; a swap that fails goes back to the last good folder the same way.
   If that fails too, the error says so: the server must be restarted (a supervised server
   comes back with the base weights, and readiness serves the version again). Rollback is the
   same swap to an older folder.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict
from safetensors import safe_open

from memory import folders
from serving import access
from serving.errors import ServingError

log = logging.getLogger(__name__)

RELOAD_TIMEOUT_S = 600.0
CACHE_RESET_TRIES = 20


class Reference(BaseModel):
    """The trainer's own greedy continuation of one fixed prompt, with its log-probabilities."""

    model_config = ConfigDict(frozen=True)

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


class Served(BaseModel):
    """A version's merged weights: its name (the server's label) and its model folder."""

    model_config = ConfigDict(frozen=True)

    version: str
    folder: Path


class SwapReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    version: str
    seconds: float
    max_logprob_error: float


def check_folder(folder: Path, base_model: Path) -> None:
    """Refuse a merged folder that is incomplete or does not fit the base model."""
    if not folders.is_complete(folder):
        raise ServingError(f"merged weights {folder} are not a complete folder")
    base, merged = _tensor_specs(base_model), _tensor_specs(folder)
    if set(merged) != set(base):
        missing, extra = sorted(set(base) - set(merged)), sorted(set(merged) - set(base))
        raise ServingError(
            f"merged weights {folder} do not match the base model's tensors "
            f"(missing {missing[:2]}, unexpected {extra[:2]})"
        )
    for name, spec in merged.items():
        if spec != base[name]:
            raise ServingError(f"merged weights {folder}: {name} is {spec}, not {base[name]}")
    _check_finite(folder)


def references(folder: Path) -> list[Reference]:
    path = folder / folders.REFERENCE
    try:
        return [Reference.model_validate(r) for r in json.loads(path.read_text())]
    except (OSError, ValueError) as exc:
        raise ServingError(f"merged weights {folder} have no readable {path.name}") from exc


def serve(
    url: str,
    model: str,
    target: Served,
    base_model: Path,
    last_good: Served | None = None,
    tolerance: float = 0.05,
) -> SwapReport:
    """Check `target` against the base model, then swap the server to it; a swap that fails
    goes back to `last_good` and raises (module docstring, 3)."""
    check_folder(target.folder, base_model)
    try:
        return swap(url, model, target.folder, target.version, tolerance)
    except ServingError as failure:
        if last_good is None:
            raise
        log.warning(
            "swap to %s failed (%s); back to %s", target.version, failure, last_good.version
        )
        try:
            swap(url, model, last_good.folder, last_good.version, tolerance)
        except ServingError as again:
            raise ServingError(
                f"{failure}; and going back to {last_good.version} failed too ({again}): "
                "restart the server"
            ) from again
        raise


def swap(url: str, model: str, folder: Path, version: str, tolerance: float) -> SwapReport:
    """Reload `folder` into the server at `url` in place and prove it answers with it (a folder
    without a reference, the base model's own, is proved by a generation only)."""
    started = time.monotonic()
    expected = references(folder) if (folder / folders.REFERENCE).is_file() else []
    with httpx.Client(base_url=url, timeout=RELOAD_TIMEOUT_S, headers=access.headers()) as client:
        _post(client, "/pause", params={"mode": "wait"})
        try:
            body = {
                "method": "reload_weights",
                "kwargs": {"weights_path": str(folder.resolve())},
                "timeout": RELOAD_TIMEOUT_S,
            }
            _post(client, "/collective_rpc", json=body)
            _reset_prefix_cache(client)
            _post(client, "/update_weight_version", json={"new_version": version})
        finally:
            _post(client, "/resume")
        error = max((_logprob_error(client, model, ref) for ref in expected), default=0.0)
        if not expected:
            _post(client, "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
    if error > tolerance:
        raise ServingError(
            f"after reloading {folder.name}, the server's log-probabilities differ from the "
            f"trainer's by {error:.3f} (tolerance {tolerance}): the weights did not take"
        )
    return SwapReport(version=version, seconds=time.monotonic() - started, max_logprob_error=error)


def weight_version(url: str) -> str | None:
    """The version label the server says it serves (None without the dev routes)."""
    try:
        response = httpx.get(f"{url}/weight_info", timeout=10.0, headers=access.headers())
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    label = response.json().get("weight_version")
    return str(label) if label is not None else None


def _post(client: httpx.Client, route: str, **kwargs: Any) -> httpx.Response:
    try:
        response = client.post(route, **kwargs)
    except httpx.HTTPError as exc:
        raise ServingError(f"{route} failed: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise ServingError(f"{route} answered {response.status_code}: {response.text[:200]}")
    return response


def _reset_prefix_cache(client: httpx.Client) -> None:
    """The prefix cache must be empty before the new weights answer: retried while requests
    still hold blocks, a failure if it never succeeds."""
    for _ in range(CACHE_RESET_TRIES):
        if _post(client, "/reset_prefix_cache").json().get("success"):
            return
        time.sleep(0.25)
    raise ServingError("the prefix cache could not be reset; the old weights' blocks remain")


def _logprob_error(client: httpx.Client, model: str, ref: Reference) -> float:
    """The largest difference between the server's log-probabilities of the reference tokens
    (teacher-forced, as prompt log-probabilities) and the trainer's."""
    body = {
        "model": model,
        "prompt": ref.prompt_ids + ref.completion_ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }
    response = _post(client, "/v1/completions", json=body)
    served = response.json()["choices"][0].get("prompt_logprobs") or []
    tail = served[len(ref.prompt_ids) :]
    errors = []
    for token, expected, entry in zip(ref.completion_ids, ref.logprobs, tail, strict=False):
        got = (entry or {}).get(str(token), {}).get("logprob")
        errors.append(math.inf if got is None else abs(float(got) - expected))
    return max(errors, default=math.inf)


def _tensor_specs(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as tensors:
                for name in tensors.keys():  # noqa: SIM118
                    piece = tensors.get_slice(name)
                    specs[name] = (tuple(piece.get_shape()), str(piece.get_dtype()))
        except Exception as exc:  # noqa: BLE001 - safetensors raises several unrelated types
            raise ServingError(f"{file} is not readable safetensors: {exc}") from exc
    if not specs:
        raise ServingError(f"{folder} holds no safetensors weights")
    return specs


def _check_finite(folder: Path) -> None:
    import torch

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118
                if not bool(torch.isfinite(tensors.get_tensor(name)).all()):
                    raise ServingError(f"merged weights {folder}: {name} holds NaN or inf")
