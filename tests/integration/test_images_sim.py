"""Media-aware placement: the real render sidecar of the tiny vision model (``token_engine.vision_prep``)
in front of four simulated engines whose prefix caches key image blocks as vLLM's do.

What a user sees: a conversation that re-sends its image keeps landing on the engine that holds it
(and that engine serves the prompt from its cache); the same text with another image is not taken for
a match, since no engine holds it. tests/e2e/test_images_real.py shows the same keys on a real engine.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VISION, CoordinatorFactory
from tests.support import LONG_HISTORY, served_by
from token_engine.simulator import SimConfig, SimulatedEngine


@pytest.fixture
def fleet() -> Iterator[dict[str, SimulatedEngine]]:
    cfg = {"model": VISION, "vocab_size": 49156, "decode_s_per_token": 0.001}
    with ExitStack() as stack:
        yield {f"e{i}": stack.enter_context(SimulatedEngine(SimConfig(seed=i, **cfg))) for i in range(4)}


def png(color: str) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (40, 40), color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": VISION, "messages": messages, "max_tokens": 8, "temperature": 0}


def first_turn(image: str, topic: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": LONG_HISTORY},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": f"Describe the {topic} in this photo."}]}]


def test_a_conversation_resending_its_image_stays_where_its_blocks_are(
        vision_render: Any, fleet: dict[str, SimulatedEngine], coordinator_factory: CoordinatorFactory) -> None:
    # A tight bound on each engine's share of decisions spreads the new conversations (they share
    # everything up to their images); a conversation's next turn continues its chain, which the
    # bound never moves.
    coord = coordinator_factory(str(vision_render.url), [s.url for s in fleet.values()],
                                models=[{"name": VISION}],
                                scheduling={"bounded_load": {"factor": 1.0, "slack": 1.0}})

    def post(body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{coord.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())

    colors = ["red", "green", "blue", "yellow", "purple", "teal"]
    homes: dict[str, str] = {}
    answers: dict[str, dict[str, Any]] = {}
    for color in colors:
        homes[color] = served_by(fleet, lambda c=color: answers.__setitem__(c, post(turn(first_turn(png(c), "light")))))
    assert len(set(homes.values())) >= 3, homes
    for color in colors:
        history = first_turn(png(color), "light")
        history += [{"role": "assistant", "content": answers[color]["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And what colour is it?"}]
        engine = fleet[homes[color]]
        before = engine.state()["prefix_cache"]["hits"]
        assert served_by(fleet, lambda h=history: post(turn(h))) == homes[color], color
        # The whole first turn's prompt, image included, came from that engine's cache.
        assert engine.state()["prefix_cache"]["hits"] - before >= answers[color]["usage"]["prompt_tokens"] - 16

    # The coordinator's index, asked with render's own hashes: each conversation's first prompt is held
    # whole by its home; the same text with an image no engine has seen matches only the blocks before
    # the image, where token-only hashes would match it whole on every home.
    def index_match(color: str) -> tuple[dict[str, int], int, int]:
        r = httpx.post(f"{vision_render.url}/v1/chat/completions/render", timeout=60,
                       json=turn(first_turn(png(color), "light")), headers={"x-prefix-hash": f"16 {VISION}"})
        doc = r.json()
        matched, _ = coord.components.scheduler.memory.lookup(doc["block_hashes"])
        image_at = doc["features"]["mm_placeholders"]["image"][0]["offset"]
        return matched, len(doc["token_ids"]) // 16, image_at // 16

    urls = {k: s.url for k, s in fleet.items()}
    matched, blocks, before_image = index_match("red")
    assert matched[urls[homes["red"]]] == blocks
    matched, blocks, before_image = index_match("black")
    assert matched and max(matched.values()) == before_image < blocks, (matched, before_image, blocks)


def test_multimodal_benchmark_quick(vision_render: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """perf.multimodal's smoke run on the real vision render sidecar: every policy answers every turn,
    and the report, its plot and the headline are written (the ratios are the benchmark's, not a test's)."""
    import json

    import perf._report
    from perf import multimodal

    monkeypatch.setattr(perf._report, "OUT_ROOT", tmp_path)
    multimodal.main(["--quick", "--render-url", str(vision_render.url)])
    head = json.loads([line for line in capsys.readouterr().out.splitlines() if line.strip()][-1])
    assert head["benchmark"] == "multimodal" and head["failed"] == 0
    runs = {r["policy"]: r for r in json.loads((tmp_path / "multimodal" / "result.json").read_text())["runs"]}
    assert set(runs) == {"media", "text_only", "round_robin", "epd"}
    assert all(r["requests"] == 4 for r in runs.values())    # --quick: 4 conversations, 1 follow-up each
    assert runs["media"]["prefix_hit_rate"] > 0
    assert (tmp_path / "multimodal" / "multimodal.png").stat().st_size > 0
