"""Readiness: does the model server generate with the version a stage needs, right now?

1. One generation probe (`serving.probe`) answers it.
2. A LoRA server serves each version under its own name. A version the store knows as an
   adapter, which the server no longer lists (it was restarted, by its supervisor or by hand),
   is loaded again before anything samples from it.
3. A server of merged weights (vLLM's dev routes answer `/weight_info`) serves one version at a
   time, under its one model name, labelled with the version. Requests ask for that name
   (`served_as`). Only a flow's stage may swap the weights (`ensure(..., swap=True)`), from the
   version's merged folder in the store; a worker waits until the label is the version of its
   batch, so two batches never pull the weights back and forth.
4. `ensure` waits out an outage: it probes with backoff until the server generates again or
   `wait_s` has passed, then raises `ServerUnavailable` naming the server and the last reason.
   Workers call it before each lot, flows before each stage, so nothing is sampled from a
   server that is down or serves the wrong weights, and nothing is recorded from one.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import anyio
import httpx
from sqlalchemy import Engine

from agents.errors import ServerUnavailable
from memory import store
from memory.errors import StoreError
from memory.records import PolicyVersion
from serving import access, adapters, probe, weights
from serving.errors import ServingError

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0
MAX_DELAY_S = 10.0
FRESH_S = 10.0  # a probe this recent answers `ensure` without another
BASE_LABELS = (None, "default")  # a merged-weights server fresh from its base model


class Readiness:
    """Probes one model server for the versions the store knows (see the module docstring)."""

    def __init__(self, engine: Engine, server_url: str, outage_s: float) -> None:
        self.engine = engine
        self.server_url = server_url.rstrip("/")
        self.outage_s = outage_s
        self._ok_at: dict[str, float] = {}
        self._served: dict[str, str] = {}
        self._swapping = threading.Lock()

    def served_as(self, version: str) -> str:
        """The model name requests for `version` ask for (its own name, unless the server holds
        merged weights under one name)."""
        return self._served.get(version, version)

    async def ensure(
        self,
        version: str,
        wait_s: float | None = None,
        swap: bool = False,
        any_weights: bool = False,
    ) -> None:
        """Return once the server generates with `version`; raise `ServerUnavailable` when it has
        not within `wait_s` (default: the outage allowance). `swap`: a merged-weights server
        holding other weights is swapped to `version`'s (a flow's stage), else waited for.
        `any_weights`: a merged-weights server may hold any version (a preflight)."""
        if time.monotonic() - self._ok_at.get(version, -FRESH_S) < FRESH_S:
            return
        deadline = time.monotonic() + (self.outage_s if wait_s is None else wait_s)
        delay, warned = 1.0, False
        while True:
            reason = await anyio.to_thread.run_sync(self.check, version, swap, any_weights)
            if reason is None:
                if warned:
                    log.warning("%s generates with %s again", self.server_url, version)
                return
            if time.monotonic() + delay > deadline:
                raise ServerUnavailable(
                    f"the model server at {self.server_url} does not generate with {version}: "
                    f"{reason}"
                )
            if not warned:
                log.warning("waiting for the model server at %s: %s", self.server_url, reason)
                warned = True
            await anyio.sleep(delay)
            delay = min(2 * delay, MAX_DELAY_S)

    def check(self, version: str, swap: bool = False, any_weights: bool = False) -> str | None:
        """One probe (restoring lost weights first, where allowed); None when it generates
        with `version`, else why not."""
        label = weights.weight_version(self.server_url)
        if label is not None:
            reason = self._check_merged(version, label, swap, any_weights)
        else:
            reason = self._check_named(version)
        if reason is None and not any_weights:
            self._ok_at[version] = time.monotonic()
        elif reason is not None:
            self._ok_at.pop(version, None)
        return reason

    def _check_named(self, version: str) -> str | None:
        with httpx.Client(
            base_url=self.server_url, timeout=PROBE_TIMEOUT_S, headers=access.headers()
        ) as client:
            found = probe.generation(client, version)
            if not found.ok and found.status == 404 and self._restore_adapter(version):
                found = probe.generation(client, version)
        return None if found.ok else found.reason

    def _check_merged(self, version: str, label: str, swap: bool, any_weights: bool) -> str | None:
        try:
            served = adapters.loaded_models(self.server_url)[0]
        except (httpx.HTTPError, IndexError) as exc:
            return f"no model listed: {exc}"
        holds = any_weights or label == version or (version == served and label in BASE_LABELS)
        if not holds:
            if not swap:
                return f"it holds the weights of {label}, not {version}"
            if (failure := self._swap_to(version, served)) is not None:
                return failure
        self._served[version] = served
        with httpx.Client(
            base_url=self.server_url, timeout=PROBE_TIMEOUT_S, headers=access.headers()
        ) as client:
            found = probe.generation(client, served)
        return None if found.ok else found.reason

    def _swap_to(self, version: str, served: str) -> str | None:
        """Reload `version`'s merged weights in place; None when done, else why not."""
        with self._swapping:
            record, base = self._version(version), None
            if record is not None:
                base = self._version(record.base_model)
            if record is None or record.weights_path is None:
                return f"the store has no merged weights for {version}"
            base_folder = Path(base.weights_path) if base and base.weights_path else None
            if base_folder is None:
                return f"the store has no model folder for the base {record.base_model}"
            target = weights.Served(version=version, folder=Path(record.weights_path))
            try:
                report = weights.serve(self.server_url, served, target, base_folder)
            except (ServingError, httpx.HTTPError) as exc:
                return f"swapping to {version} failed: {exc}"
        log.info("%s now holds %s (%.1f s)", self.server_url, version, report.seconds)
        return None

    def _version(self, name: str) -> PolicyVersion | None:
        try:
            with store.transaction(self.engine) as session:
                return store.policy_version(session, name)
        except StoreError:
            return None

    def _restore_adapter(self, model: str) -> bool:
        """Load `model`'s adapter again if the store knows it; whether it was loaded."""
        version = self._version(model)
        if version is None or version.adapter_path is None:
            return False
        try:
            adapters.ensure_loaded(self.server_url, model, Path(version.adapter_path))
        except (ServingError, httpx.HTTPError) as exc:
            log.warning("could not serve %s again on %s: %s", model, self.server_url, exc)
            return False
        log.warning("served %s again on %s (the server had lost it)", model, self.server_url)
        return True
