"""Merged weights reloaded in place, on a real vLLM server (the tiny model, dev routes, no LoRA):
swaps under load lose no request, the served log-probabilities and greedy output are the
trainer's own after a swap, a corrupt folder is refused before any server sees it, a reload
that fails part-way goes back to the last good weights, and the LoRA path agrees."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from memory import folders
from serving import weights
from serving.errors import ServingError
from tests.helpers import random_adapter, tiny_vllm
from trainer.merge import merge_version

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def versions(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two merged versions of the tiny model, with the adapters they came from."""
    root = tmp_path_factory.mktemp("versions")
    made = {}
    for index, name in enumerate(("v1", "v2")):
        torch.manual_seed(index)
        adapter = random_adapter(tiny_model_path, root / "adapters", name, std=1.0)
        made[name] = merge_version(tiny_model_path, adapter, root / "merged", name)
        made[f"{name}-adapter"] = adapter
    return made


@pytest.fixture(scope="module")
def merged_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    with tiny_vllm(tiny_model_path, tmp_path_factory.mktemp("merged"), weights="merged") as server:
        yield server


def greedy_ids(url: str, model: str, prompt_ids: list[int], count: int) -> list[int]:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": count, "temperature": 0.0}
    body |= {"return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


def test_a_swap_serves_the_trainers_own_weights(merged_server, versions, tiny_model_path) -> None:
    url, model = merged_server.url, tiny_model_path.name
    reference = weights.references(versions["v1"])[0]
    before = greedy_ids(url, model, reference.prompt_ids, len(reference.completion_ids))
    report = weights.serve(url, model, weights.Served(version="v1", folder=versions["v1"]),
                           tiny_model_path)  # fmt: skip
    after = greedy_ids(url, model, reference.prompt_ids, len(reference.completion_ids))
    assert weights.weight_version(url) == "v1"
    assert report.max_logprob_error < 1e-3
    assert after == reference.completion_ids != before  # the text changed, to the trainer's


def test_swaps_under_steady_load_drop_no_request(merged_server, versions, tiny_model_path) -> None:
    url, model = merged_server.url, tiny_model_path.name
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()

    def load() -> None:
        body = {"model": model, "prompt": "Count to ten:", "max_tokens": 16, "temperature": 1.0}
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                response = client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    errors.append(f"{response.status_code} {response.text[:80]}")
                answered[0] += 1

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for name in ("v1", "v2", "v1", "v2"):
            target = weights.Served(version=name, folder=versions[name])
            weights.serve(url, model, target, tiny_model_path)
            assert weights.weight_version(url) == name
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == [] and answered[0] > 8


def corrupt(good: Path, root: Path, kind: str) -> Path:
    target = root / f"corrupt-{kind}"
    shutil.copytree(good, target)
    weights_file = target / "model.safetensors"
    tensors = load_file(weights_file)
    name = sorted(tensors)[0]
    if kind == "truncated":
        weights_file.write_bytes(weights_file.read_bytes()[:4096])
    elif kind == "nan":
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float("nan")
        save_file(tensors, weights_file)
    elif kind == "shape":
        tensors[name] = tensors[name][:-1].clone()
        save_file(tensors, weights_file)
    elif kind == "renamed":
        tensors[name.replace("model.", "other.")] = tensors.pop(name)
        save_file(tensors, weights_file)
    elif kind == "unfinished":
        (target / folders.MARKER).unlink()
    return target


@pytest.mark.parametrize("kind", ["truncated", "nan", "shape", "renamed", "unfinished"])
def test_a_corrupt_folder_is_refused_before_any_server_sees_it(
    merged_server, versions, tiny_model_path, tmp_path: Path, kind: str
) -> None:
    url = merged_server.url
    label = weights.weight_version(url)
    bad = corrupt(versions["v2"], tmp_path, kind)
    with pytest.raises(ServingError, match="merged weights|not readable"):
        weights.serve(url, tiny_model_path.name, weights.Served(version="bad", folder=bad),
                      tiny_model_path)  # fmt: skip
    assert weights.weight_version(url) == label  # the server never saw it


def test_a_reload_that_fails_part_way_goes_back_to_the_last_good_weights(
    merged_server, versions, tiny_model_path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, model = merged_server.url, tiny_model_path.name
    weights.serve(url, model, weights.Served(version="v1", folder=versions["v1"]), tiny_model_path)
    broken = tmp_path / "v2-broken"
    shutil.copytree(versions["v2"], broken)
    (broken / "model.safetensors").unlink()  # passes no check; we skip the check to get here
    monkeypatch.setattr(weights, "check_folder", lambda folder, base: None)
    last_good = weights.Served(version="v1", folder=versions["v1"])
    with pytest.raises(ServingError):
        weights.serve(url, model, weights.Served(version="v2", folder=broken), tiny_model_path,
                      last_good=last_good)  # fmt: skip
    assert weights.weight_version(url) == "v1"
    reference = weights.references(versions["v1"])[0]
    again = greedy_ids(url, model, reference.prompt_ids, len(reference.completion_ids))
    assert again == reference.completion_ids


def test_the_lora_path_gives_the_same_log_probabilities(
    tiny_server: str, versions, tiny_model_path
) -> None:
    """The merged folder and its adapter are the same version: served as a LoRA, the reference
    tokens get the trainer's log-probabilities too (what the evaluation gate relies on)."""
    from serving.adapters import ensure_loaded

    ensure_loaded(tiny_server, "v1-lora", versions["v1-adapter"])
    with httpx.Client(base_url=tiny_server, timeout=60) as client:
        errors = [
            weights._logprob_error(client, "v1-lora", ref)
            for ref in weights.references(versions["v1"])
        ]
    assert max(errors) < 1e-2, errors
    assert json.loads((versions["v1"] / "reference.json").read_text())


def test_a_round_with_merged_weights_through_the_cli(
    merged_server, tiny_model_path: Path, tmp_path: Path
) -> None:
    """`flywheel run --weights merged`: the round's adapter is merged and published, the server
    is swapped to it for the held-out evaluation, and the version the gate chose serves after."""
    from cli.main import main
    from memory import store
    from tests.helpers import make_group
    from verifiers.reasoning import eval_tasks, train_tasks

    db = f"sqlite:///{tmp_path / 'merged.db'}"
    engine = store.open_store(db)
    tasks = train_tasks("arithmetic", 4, seed=1, held_out=eval_tasks("arithmetic", 2))
    with store.transaction(engine) as session:  # a random model earns nothing: seed round 1
        for task in tasks:
            group = make_group([1.0, 0.0, 0.0, 1.0], task_id=task.task_id, completion_len=8)
            update = {"policy_version": tiny_model_path.name, "question": task.question}
            store.save_group(session, group.model_copy(update=update))
    summary = tmp_path / "summary.json"
    args = [
        "run", "--db", db, "--workdir", str(tmp_path), "--model", str(tiny_model_path),
        "--server-url", merged_server.url, "--weights", "merged", "--rounds", "1",
        "--tasks", "4", "--group-size", "4", "--eval-tasks", "2", "--mode", "grpo",
        "--prefect", "temporary", "--summary-json", str(summary),
    ]  # fmt: skip
    assert main(args) == 0
    (round_,) = json.loads(summary.read_text())["rounds"]
    with store.transaction(engine) as session:
        version = store.policy_version(session, round_["policy_version"])
        serving = store.promoted_policy(session)
    assert version.weights_path and folders.is_complete(Path(version.weights_path))
    assert weights.references(Path(version.weights_path))  # the trainer's own outputs
    assert weights.weight_version(merged_server.url) == (
        version.name if round_["promoted"] else serving.name
    )
