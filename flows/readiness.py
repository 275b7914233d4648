"""Readiness: does the model server generate with the model a stage needs, right now?

1. One generation probe (`serving.probe`) under the version's served name answers it.
2. A version the store knows as an adapter, which the server no longer lists (it was restarted,
   by its supervisor or by hand), is loaded again before anything samples from it.
3. `ensure` waits out an outage: it probes with backoff until the server generates again or
   `wait_s` has passed, then raises `ServerUnavailable` naming the server and the last reason.
   Workers call it before each lot, flows before each stage, so nothing is sampled from a
   server that is down or serves the wrong model, and nothing is recorded from one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import httpx
from sqlalchemy import Engine

from agents.errors import ServerUnavailable
from memory import store
from memory.errors import StoreError
from serving import adapters, probe
from serving.errors import ServingError

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0
MAX_DELAY_S = 10.0
FRESH_S = 10.0  # a probe this recent answers `ensure` without another


class Readiness:
    """Probes one model server for the versions the store knows (see the module docstring)."""

    def __init__(self, engine: Engine, server_url: str, outage_s: float) -> None:
        self.engine = engine
        self.server_url = server_url.rstrip("/")
        self.outage_s = outage_s
        self._ok_at: dict[str, float] = {}

    async def ensure(self, model: str, wait_s: float | None = None) -> None:
        """Return once the server generates with `model`; raise `ServerUnavailable` when it has
        not within `wait_s` (default: the outage allowance)."""
        if time.monotonic() - self._ok_at.get(model, -FRESH_S) < FRESH_S:
            return
        deadline = time.monotonic() + (self.outage_s if wait_s is None else wait_s)
        delay, warned = 1.0, False
        while True:
            reason = await anyio.to_thread.run_sync(self.check, model)
            if reason is None:
                if warned:
                    log.warning("%s generates with %s again", self.server_url, model)
                return
            if time.monotonic() + delay > deadline:
                raise ServerUnavailable(
                    f"the model server at {self.server_url} does not generate with {model}: "
                    f"{reason}"
                )
            if not warned:
                log.warning("waiting for the model server at %s: %s", self.server_url, reason)
                warned = True
            await anyio.sleep(delay)
            delay = min(2 * delay, MAX_DELAY_S)

    def check(self, model: str) -> str | None:
        """One probe (restoring a lost adapter first); None when it generates, else why not."""
        with httpx.Client(base_url=self.server_url, timeout=PROBE_TIMEOUT_S) as client:
            found = probe.generation(client, model)
            if found.ok:
                return None
            if found.status == 404 and self._restore(model):
                found = probe.generation(client, model)
        if found.ok:
            self._ok_at[model] = time.monotonic()
            return None
        self._ok_at.pop(model, None)
        return found.reason

    def _restore(self, model: str) -> bool:
        """Load `model`'s adapter again if the store knows it; whether it was loaded."""
        try:
            with store.transaction(self.engine) as session:
                version = store.policy_version(session, model)
        except StoreError:
            return False
        if version.adapter_path is None:
            return False
        try:
            adapters.ensure_loaded(self.server_url, model, Path(version.adapter_path))
        except (ServingError, httpx.HTTPError) as exc:
            log.warning("could not serve %s again on %s: %s", model, self.server_url, exc)
            return False
        log.warning("served %s again on %s (the server had lost it)", model, self.server_url)
        return True
