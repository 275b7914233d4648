"""serving: the model server, new versions into it, and the OpenAI-compatible gateway.

Public surface:
- `serving.server`: `VllmServer` (start, probe, supervise, restart), `ServerSettings`.
- `serving.model`: model folders (`prepare_smollm2`, `prepare_tiny_llama`).
- `serving.adapters`: validate, hot-load and canary an adapter; `ensure_loaded`.
- `serving.gateway`: `create_app`, `GatewaySettings`, `running`; its `serving.router`.
- `serving.promotion`: the evaluation gate, promote and rollback. `serving.capture`: traffic
  as trajectories. `serving.probe`: the 1-token generation probe.
- `serving.errors`: `ServingError`, `UpstreamError`.
"""
