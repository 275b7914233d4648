"""Admin commands: the model server, the gateway, promotion and rollback, the sandbox, the model
folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cli.arguments import db_url, keys, model_folder
from flows.errors import FlowError


def serve_model(args: argparse.Namespace) -> int:
    import threading

    from serving.server import ServerSettings, VllmServer

    model_path = model_folder(args.model, args.models)
    settings = ServerSettings(
        python=args.server_python,
        model_path=model_path,
        served_name=model_path.name,
        port=args.port,
        weights=args.weights,
        log_path=args.workdir / "logs" / f"vllm-{args.port}.log",
        api_key=_server_key(args.workdir),
    )
    stop = threading.Event()
    with VllmServer(settings) as server:
        print(f"vLLM serving {model_path.name} on {server.url}; Ctrl-C stops it", file=sys.stderr)
        try:
            server.supervise(stop, interval_s=args.probe_interval)
        except KeyboardInterrupt:
            stop.set()
    return 0


def _server_key(workdir: Path) -> str:
    """The model server's own key: FLYWHEEL_SERVER_KEY, else a new one kept (readable by this
    user alone) in WORKDIR/server.key, for the workers and gateways that will call it."""
    from serving.access import ENV, ensure_key, key

    existing = key()
    if existing is not None:
        return existing
    made = ensure_key()  # set in this process's environment too, as every starter does
    path = workdir / "server.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(made + "\n", encoding="utf-8")
    print(f"model server key in {path}: export {ENV}=$(cat {path}) for its clients",
          file=sys.stderr)  # fmt: skip
    return made


def gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from memory.store import open_store
    from serving.gateway import GatewaySettings, create_app
    from serving.limits import RequestLimits
    from serving.promotion import Gate

    admin_keys = keys("FLYWHEEL_ADMIN_KEYS")
    if not admin_keys:
        raise FlowError("set FLYWHEEL_ADMIN_KEYS (comma-separated) to protect the admin routes")
    settings = GatewaySettings(
        upstreams=[u.rstrip("/") for u in args.upstream],
        base_model_path=model_folder(args.model, args.models),
        adapters_root=args.workdir / "adapters",
        alias=args.alias,
        user_keys=keys("FLYWHEEL_API_KEYS"),
        admin_keys=admin_keys,
        gate=Gate(min_gain=args.min_gain, held_out_share=args.held_out_share),
        capture=args.capture,
        uncaptured_keys=keys("FLYWHEEL_UNCAPTURED_KEYS"),
        taskset=args.taskset,
        limits=RequestLimits(rate_per_s=args.rate, burst=args.burst),
    )
    if args.taskset is not None:
        from verifiers.catalog import check

        check(args.taskset)  # an unknown or broken task set fails here, in one line
    from serving.server import ensure_port_free

    ensure_port_free(args.host, args.port)
    app = create_app(settings, open_store(db_url(args)))
    print(f"gateway on http://{args.host}:{args.port}/v1, alias {args.alias!r}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def promote(args: argparse.Namespace) -> int:
    """Through the gateway when one is named (it serves the version everywhere, then records
    the decision; its own gate applies), else straight in the store."""
    if args.gateway_url:
        body = {"version": args.version, "force": args.force}
        event = _ask_gateway(args.gateway_url, "/admin/promote", body)
    else:
        from memory import store
        from serving import promotion

        with store.transaction(store.open_store(db_url(args))) as session:
            gate = promotion.Gate(min_gain=args.min_gain)
            recorded = promotion.promote(session, args.version, gate, force=args.force)
        event = recorded.model_dump()
    if event["action"] != "promote":
        raise FlowError(f"not promoted: {event['reason']}")
    print(f"{event['to_version']} now serves (was {event['from_version']}): {event['reason']}")
    return 0


def rollback(args: argparse.Namespace) -> int:
    if args.gateway_url:
        event = _ask_gateway(args.gateway_url, "/admin/rollback", None)
    else:
        from memory import store
        from serving import promotion

        with store.transaction(store.open_store(db_url(args))) as session:
            event = promotion.rollback(session).model_dump()
    print(f"{event['to_version']} now serves (was {event['from_version']})")
    return 0


def _ask_gateway(url: str, route: str, body: Any) -> dict[str, Any]:
    """An admin request to a running gateway; any failure is one line, and the gateway changes
    nothing it could not finish."""
    import httpx

    key = next(iter(keys("FLYWHEEL_ADMIN_KEYS")), "")
    try:
        response = httpx.post(
            url.rstrip("/") + route,
            json=body,
            timeout=300,
            headers={"Authorization": f"Bearer {key}"},
        )
    except httpx.HTTPError as exc:
        raise FlowError(f"the gateway at {url} cannot be reached ({exc}); nothing changed") from exc
    if response.status_code in (200, 409):
        return dict(response.json())
    try:
        reason = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        reason = response.text.strip()[:200]
    raise FlowError(f"the gateway answered {response.status_code}: {reason}; nothing changed")


def sandbox(args: argparse.Namespace) -> int:
    from verifiers.sandbox import Isolation, enforcement

    found = enforcement()
    blocks = {
        Isolation.BUBBLEWRAP: "no network, no host files but /usr, private /tmp and /dev/shm",
        Isolation.UNSHARE: "no network, own pid namespace, an unprivileged uid; host files "
        "readable",
        Isolation.PROCESS: "rlimits and a dropped uid only; the network stays reachable",
    }[found.isolation]
    limits = found.limits
    print(f"sandbox isolation: {found.isolation} ({blocks})")
    print(f"cgroup: {found.cgroup} (pids {limits.processes}, memory {limits.memory_mb} MB)")
    print(f"rlimits: {limits.cpu_s} CPU s, {limits.wall_s:g} s wall, {limits.processes} processes, "
          f"{limits.memory_mb} MB address space, {limits.file_mb} MB files, "
          f"{limits.tmp_mb} MB /tmp and /dev/shm, {limits.output_bytes} output bytes")  # fmt: skip
    if found.isolation is not Isolation.BUBBLEWRAP:
        print("code task sets refuse to run here: install bubblewrap (apt-get install bubblewrap)")
    return 0


def migrate(args: argparse.Namespace) -> int:
    from memory.database import migrate as upgrade

    before, after = upgrade(db_url(args))
    done = f"schema {before or 'none'} -> {after}"
    print(f"schema already at {after}" if before == after else done)
    return 0


def prepare_model(args: argparse.Namespace) -> int:
    print(model_folder(args.model, args.models))
    return 0
