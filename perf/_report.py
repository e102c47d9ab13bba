"""Shared benchmark output: percentiles, progress lines, the JSON last line, report files."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

OUT_ROOT = Path(__file__).resolve().parent / "out"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": round(pct(ms, 50), 2), "p90_ms": round(pct(ms, 90), 2), "p99_ms": round(pct(ms, 99), 2),
            "mean_ms": round(statistics.fmean(ms), 2) if ms else float("nan")}


class Progress:
    """One line per step with elapsed seconds, flushed (benchmarks run for minutes)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{self.name} {time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)


def save_figure(fig: Any, path: Path) -> None:
    """Every benchmark's plot the same way: tight layout, 110 dpi PNG, figure closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(name: str, figures: dict[str, Any], markdown: str) -> Path:
    out = OUT_ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(figures, indent=2))
    (out / "report.md").write_text(markdown)
    return out


def final_json(figures: dict[str, Any]) -> None:
    """Print the last line; also keep it as ``last_line.json`` next to the report (for perf.docs)."""
    line = json.dumps(figures, separators=(",", ":"))
    out = OUT_ROOT / str(figures.get("benchmark", ""))
    if figures.get("benchmark") and out.is_dir():
        (out / "last_line.json").write_text(line + "\n")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
