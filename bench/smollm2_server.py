"""The model server a benchmark runs against: the one at `--server-url`, or SmolLM2 started here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from serving.model import prepare_smollm2
from serving.server import ServerSettings, VllmServer

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def smollm2_server(server_url: str | None, port: int, log_name: str) -> Iterator[tuple[str, Path]]:
    """Yield (server URL, model folder); a server started here is stopped on exit."""
    model = prepare_smollm2(ROOT / ".flywheel" / "models")
    if server_url:
        yield server_url, model
        return
    settings = ServerSettings(
        python=ROOT / ".venv-serving" / "bin" / "python",
        model_path=model,
        served_name=model.name,
        port=port,
        log_path=ROOT / ".flywheel" / "logs" / log_name,
    )
    with VllmServer(settings) as server:
        yield server.url, model
