"""The results page: `bench/README.md`, written from `bench/results/*.json` alone.

Every results file carries its provenance (command, commit, date, machine) and its headline
figures, each with n and a 95% interval (`bench.common.write_results`); this script lays them
out, one section per benchmark and one table per file. Nothing on the page is typed by hand, and
`--check` (run by the test suite) fails when the committed page is not what the files give.
Files from earlier code, without that record, live in `bench/results/archive/`.

    .venv/bin/python -m bench.results [--check]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PAGE = BENCH / "README.md"
SCRIPT = re.compile(r"^(\S*python3?) bench/(\w+)\.py")
# The run benchmark's seconds per stage, shown as one table: a row per arm, a column per stage.
STAGE = re.compile(r"^(?P<arm>.+): (?P<stage>\w+) stage, all rounds$")
# Sections in reading order: serving, then data, then learning; others follow by name.
ORDER = ("sampling", "serving", "startup", "dtype", "chaos", "sandbox", "store", "pipeline",
         "train", "train_stage", "capture", "agent", "tasksets", "reviewer", "explore", "learn",
         "confirm", "replicates", "rounds", "drift", "run")  # fmt: skip

INTRO = """# Benchmarks

Every figure on this page is read from a results file in `results/` by `bench/results.py`
(`make results` writes the page; the test suite fails when it is not what the files give). Each
file records the command that produced it, the commit, the date and the machine (its CPU, cores,
and the dtype it computes natively: bfloat16 where it has AVX-512 BF16 or AMX). Each figure has
its n (the independent measurements behind it) and a 95% interval: Student's for a mean over
passes, Wilson's for a share, a paired one for a difference on the same tasks, Welch's for a
difference of arms over runs; none where one measurement has no spread to go by. "Counts" says
whose work a figure counts where that is in question: the policy's own, the reviewer's, or the
system's. What the figures taught is in [docs/experiments.md](../docs/experiments.md).
"""


@dataclass(frozen=True)
class Result:
    """One results file: where it is, how it was made, and its figures."""

    path: Path
    provenance: dict[str, Any]
    figures: list[dict[str, Any]]

    @property
    def command(self) -> str:
        """The command that made it (`as_module`)."""
        return as_module(self.provenance["command"])

    @property
    def script(self) -> str:
        return self.command.split()[2].removeprefix("bench.")


def load(folder: Path = RESULTS) -> list[Result]:
    """Every results file in `folder` (not its archive); one without provenance or figures is
    an error naming the file."""
    results = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or "provenance" not in record or "figures" not in record:
            raise SystemExit(
                f"results/{path.name}: no provenance or figures; re-measure it with "
                "today's code or move it to results/archive/"
            )
        results.append(Result(path, record["provenance"], record["figures"]))
    return results


def render(results: list[Result], archive: list[Path]) -> str:
    """The page."""
    parts = [INTRO]
    scripts = sorted({r.script for r in results}, key=_rank)
    for script in scripts:
        parts.append(f"## `{script}.py`\n\n{_headline(script)}\n")
        for result in (r for r in results if r.script == script):
            parts.append(_table(result))
    if archive:
        parts.append(
            f"## Archive\n\n{len(archive)} superseded or one-off results are in "
            "`results/archive/`, kept for the findings in docs/experiments.md that cite them; "
            "most come from earlier code and record no machine. They are not shown here.\n"
        )
    return "\n".join(parts)


def _rank(script: str) -> tuple[int, str]:
    return (ORDER.index(script) if script in ORDER else len(ORDER), script)


def _headline(script: str) -> str:
    """The first paragraph of `bench/<script>.py`'s docstring."""
    source = BENCH / f"{script}.py"
    doc = ast.get_docstring(ast.parse(source.read_text())) if source.exists() else None
    return doc.split("\n\n")[0] if doc else ""


def as_module(command: str) -> str:
    """A recorded command as a module of the bench package (files made before bench/ was a
    package name the script's file: the same script, the same arguments)."""
    return SCRIPT.sub(r"\1 -m bench.\2", command)


def _elsewhere(part: dict[str, Any], machine: dict[str, Any]) -> str:
    """Where merged runs were measured, when not on the first file's kind of machine."""
    theirs = part.get("machine", machine)
    if (theirs["cpu"], theirs["cores"]) == (machine["cpu"], machine["cores"]):
        return ""
    return f" on {theirs['cpu']}, {theirs['cores']} cores"


def _table(result: Result) -> str:
    made = result.provenance
    machine = made["machine"]
    native = f"native {machine['dtype']}" if "dtype" in machine else "native dtype not recorded"
    where = f"{machine['cpu']}, {machine['cores']} cores, {native}"
    dirty = " (uncommitted changes)" if made.get("dirty") else ""
    again = made.get("refigured")
    refigured = f" · figures recomputed at `{again['commit']}`" if again else ""
    merged = made.get("merged", [])
    added = "".join(
        f" · runs added {part['date'][:10]} at `{part['commit']}`{_elsewhere(part, machine)}"
        for part in merged
    )
    lines = [
        f"`results/{result.path.name}` · {made['date'][:10]} · commit "
        f"`{made['commit']}`{dirty} · {where}{refigured}{added}",
        "",
        f"    {result.command}",
        *[f"    {as_module(part['command'])}" for part in merged],
        *([f"    {as_module(made['merged_by'])}"] if merged else []),
        "",
        "| figure | value | n | 95% interval | counts |",
        "|---|---:|---:|---|---|",
    ]
    staged = [f for f in result.figures if result.script == "run" and STAGE.match(f["name"])]
    for figure in result.figures:
        if figure in staged:
            continue
        lines.append(
            f"| {figure['name']} | {_value(figure['value'], figure['unit'])} | {figure['n']} "
            f"| {_interval(figure)} | {figure['counts'] or '-'} |"
        )
    if staged:
        lines += ["", *_stage_table(staged)]
    return "\n".join(lines) + "\n"


def _stage_table(figures: list[dict[str, Any]]) -> list[str]:
    """The figures "ARM: STAGE stage, all rounds" as one row per arm, a column per stage."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    stages: list[str] = []
    for figure in figures:
        found = STAGE.match(figure["name"])
        assert found is not None
        rows.setdefault(found["arm"], {})[found["stage"]] = figure
        stages += [found["stage"]] if found["stage"] not in stages else []
    lines = [
        "Seconds per stage over all rounds of a run (the mean over its n runs, 95% interval):",
        "",
        "| arm | n | " + " | ".join(stages) + " |",
        "|---|---:|" + "---:|" * len(stages),
    ]
    for arm, row in rows.items():
        n = next(iter(row.values()))["n"]
        cells = [_stage_cell(row.get(stage)) for stage in stages]
        lines.append(f"| {arm} | {n} | " + " | ".join(cells) + " |")
    return lines


def _stage_cell(figure: dict[str, Any] | None) -> str:
    if figure is None:
        return "-"
    interval = _interval(figure)
    return _value(figure["value"], "") + ("" if interval == "-" else f" ({interval})")


def _value(value: float, unit: str, like: float | None = None) -> str:
    """A figure (or an interval's end, formatted `like` its figure): shares to 3 decimals,
    whole numbers as they are, other numbers to 3 significant figures or more."""
    if unit == "share":
        return f"{value:.3f}"
    if isinstance(value, int) and like is None:
        return f"{value} {unit}".strip()
    size = abs(value if like is None else like)
    digits = 1 if size >= 100 else 2 if size >= 1 else 3
    return f"{value:.{digits}f} {unit}".strip()


def _interval(figure: dict[str, Any]) -> str:
    if figure["low"] is None or figure["high"] is None:
        return "-"
    unit = "share" if figure["unit"] == "share" else ""
    low, high = (_value(figure[end], unit, figure["value"]) for end in ("low", "high"))
    return f"{low} to {high}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the page is not current")
    args = parser.parse_args()
    page = render(load(), sorted((RESULTS / "archive").glob("*")))
    if args.check:
        if PAGE.read_text() != page:
            sys.exit("bench/README.md is not what bench/results/*.json give: run make results")
        return
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(BENCH.parent)} from {len(load())} results files")


if __name__ == "__main__":
    main()
