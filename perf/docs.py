"""Regenerate docs/benchmarks.md from the benchmarks' own reports.

Why: figures copied by hand go stale as the code changes; this keeps the prose (set-up, reading)
written by people and replaces only the measured part. In docs/benchmarks.md each benchmark's
figures sit between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``; this replaces that block
with ``perf/out/NAME/report.md`` (its title dropped, its plot pointing at ``img/NAME.png``, its
last-line JSON appended) and copies the plot to ``docs/img/``. A benchmark without a block gets a new
section at the end. A report from a ``--quick`` run, or a missing one, leaves the block as it is.

    python -m perf.docs [--doc docs/benchmarks.md] [--out perf/out]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `make bench` order; also the order of sections this adds.
BENCHMARKS = ("stream_overhead", "scheduler_latency", "kv_affinity", "offload_tiers", "overload", "capacity",
              "capacity_hermes", "derender_cost", "parser_chunking", "ab_native", "profile_mapper",
              "nnrp_latency", "nnrp_long_context", "topologies", "fleet_admission", "fairness", "lora",
              "multimodal", "text_paths", "responses_store")


def block(name: str, body: str) -> str:
    return f"<!-- report:{name} -->\n{body.strip()}\n<!-- /report:{name} -->"


def render_report(name: str, report: str, last_line: str | None) -> str:
    """The report as a block of the doc: no title, headings one level down, the plot in docs/img."""
    lines = report.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    text = "\n".join("#" + ln if ln.startswith("#") else ln for ln in lines).strip()
    text = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", rf"![{name.replace('_', ' ')}](img/\2)", text)
    if last_line:
        text += f"\n\nLast line: `{last_line.strip()}`"
    return text


def update(doc: str, name: str, body: str) -> str:
    pattern = re.compile(rf"<!-- report:{name} -->.*?<!-- /report:{name} -->", re.S)
    if pattern.search(doc):
        return pattern.sub(lambda _: block(name, body), doc, count=1)
    return doc.rstrip() + f"\n\n## `perf.{name}`\n\n{block(name, body)}\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--out", type=Path, default=ROOT / "perf" / "out")
    args = ap.parse_args(argv)
    doc = args.doc.read_text()
    img = args.doc.parent / "img"
    img.mkdir(exist_ok=True)
    done, kept = [], []
    for name in BENCHMARKS:
        report = args.out / name / "report.md"
        result_path = args.out / name / "result.json"
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        if not report.exists() or (result or {}).get("quick"):
            kept.append(name)
            continue
        last = args.out / name / "last_line.json"
        doc = update(doc, name, render_report(name, report.read_text(),
                                              last.read_text() if last.exists() else None))
        for png in (args.out / name).glob("*.png"):
            shutil.copyfile(png, img / png.name)
        done.append(name)
    args.doc.write_text(doc)
    print(json.dumps({"benchmark": "docs", "updated": done, "kept": kept}, separators=(",", ":")))


if __name__ == "__main__":
    main()
