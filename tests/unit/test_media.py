"""Images of a chat request checked before render fetches them (coordinator/pipeline/media.py), the
placeholder narrowing of the render sidecar, and media-aware block hashes."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from coordinator.config import MediaSettings
from coordinator.contracts.hashing import block_hashes, chain_seed, media_digest, prompt_media
from coordinator.pipeline.errors import BadRequest
from coordinator.pipeline.media import MediaPolicy
from render_sidecar.mm_placeholders import SparsePlaceholder, embed_run

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()
DNS = {"images.example.com": ["93.184.216.34"], "intranet.example.com": ["10.1.2.3"],
       "mixed.example.com": ["93.184.216.34", "127.0.0.1"]}


async def fake_dns(host: str) -> list[str]:
    if host not in DNS:
        raise OSError(f"no such host: {host}")
    return DNS[host]


def chat(*urls: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": parts}]}


async def check(body: dict[str, Any], **settings: Any) -> int:
    return await MediaPolicy(MediaSettings(**settings), resolve=fake_dns).check(body)


async def refused(body: dict[str, Any], **settings: Any) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        await check(body, **settings)
    assert info.value.status == 400
    return info.value


async def test_accepted_images_are_counted() -> None:
    assert await check(chat(PNG, "https://images.example.com/cat.png", "http://93.184.216.34/a.jpg")) == 3
    assert await check({"model": "m", "messages": [{"role": "user", "content": "text only"}]}) == 0


async def test_too_many_images_names_the_first_one_over() -> None:
    err = await refused(chat(*[PNG] * 3), max_images=2)
    assert err.param == "messages[1].content[3].image_url.url" and "At most 2 images" in err.message
    err = await refused(chat(PNG), max_images=0)
    assert "does not accept images" in err.message


@pytest.mark.parametrize("url, words", [
    ("file:///etc/passwd", "scheme file:"),
    ("ftp://images.example.com/a.png", "scheme ftp:"),
    ("images.example.com/a.png", "scheme (none)"),
    ("data:text/plain;base64,aGVsbG8=", "text/plain"),
    ("data:;base64,aGVsbG8=", "untyped"),
    ("http://127.0.0.1:8200/v1/models", "private, loopback"),
    ("http://169.254.169.254/latest/meta-data/", "private, loopback"),
    ("http://[::1]/a.png", "private, loopback"),
    ("http://[::ffff:10.0.0.1]/a.png", "private, loopback"),
    ("https://intranet.example.com/a.png", "private, loopback"),
    ("https://mixed.example.com/a.png", "private, loopback"),
    ("https://nowhere.invalid/a.png", "does not resolve"),
    ("https:///a.png", "no host"),
])
async def test_refused_urls_say_why(url: str, words: str) -> None:
    err = await refused(chat(PNG, url))
    assert err.param == "messages[1].content[2].image_url.url"
    assert words in err.message


async def test_size_schemes_and_private_addresses_follow_the_config() -> None:
    big = "data:image/png;base64," + "A" * 4000  # ~3000 bytes
    err = await refused(chat(big), max_image_bytes=2048)
    assert "exceeds the limit of 2048 bytes" in err.message
    assert await check(chat(big), max_image_bytes=4096) == 1
    err = await refused(chat("https://images.example.com/a.png"), url_schemes=["data"])
    assert "allowed: data:" in err.message
    assert await check(chat("http://10.0.0.7/a.png"), allow_private_urls=True) == 1


async def test_a_bare_string_image_url_and_a_missing_url() -> None:
    body = chat()
    body["messages"][1]["content"].append({"type": "image_url", "image_url": "http://127.0.0.1/x.png"})
    assert (await refused(body)).param == "messages[1].content[1].image_url.url"
    body["messages"][1]["content"][1] = {"type": "image_url", "image_url": {}}
    assert "non-empty string url" in (await refused(body)).message


def test_placeholders_narrow_to_their_embedding_run() -> None:
    """Idefics3: <fake><global-img> 16 x <image> <fake> → the 16 positions the embeddings fill."""
    mask = [False, False] + [True] * 16 + [False]
    assert embed_run(24, 19, mask) == (26, 16)
    assert embed_run(24, 19, None) == (24, 19)            # a dense placeholder stays as it is
    assert embed_run(5, 4, [True] * 4) == (5, 4)
    with pytest.raises(SparsePlaceholder, match="gaps"):
        embed_run(0, 6, [True, True, False, True, True, False])   # tiles with separators


def test_block_hashes_tell_images_apart() -> None:
    """Same text, same image at the same place: equal hashes; another image: equal only before it."""
    ids = [7] * 40 + [49153] * 64 + [9] * 40
    seed = chain_seed("m")

    def features(h: str) -> dict[str, Any]:
        return {"mm_hashes": {"image": [h]}, "mm_placeholders": {"image": [{"offset": 40, "length": 64}]}}

    a, a2, b = (block_hashes(ids, 16, seed, media=prompt_media(features(h))) for h in ("aa", "aa", "bb"))
    text = block_hashes(ids, 16, seed)
    assert a == a2
    assert a[:2] == b[:2] == text[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert all(x != y for x, y in zip(a[2:], text[2:], strict=True))
    assert prompt_media(features("aa")) == [(40, media_digest("aa"))] and prompt_media(None) == []


def test_simulated_engine_blocks_are_the_coordinators_media_hashes() -> None:
    """The simulator keys image blocks and publishes their ``[mm_hash, offset]`` keys as vLLM does;
    the coordinator's mirror of those events matches its own media-aware hashes of the same prompt
    (engine blocks of 64, index blocks of 16), and not those of the same text with another image."""
    from coordinator.pipeline.scheduling.prefix.index import PrefixIndex
    from coordinator.pipeline.scheduling.prefix.kv_events import KvEventMirror
    from token_engine.simulator.prefix_cache import PrefixCache, media_items

    ids = [7] * 90 + [49153] * 40 + [9] * 130
    features = {"mm_hashes": {"image": ["cafe"]}, "mm_placeholders": {"image": [{"offset": 90, "length": 40}]}}
    events: list[Any] = []
    cache = PrefixCache(64, 100, on_events=events.extend)
    cache.insert(ids, media=media_items(features))
    stored = events[0]
    assert stored.extra_keys[1] == (("cafe", 26),) and stored.extra_keys[2] == (("cafe", -38),)
    assert stored.extra_keys[0] is None and stored.extra_keys[3] is None
    assert cache.lookup(ids, media=media_items(features)) == 256
    other = {**features, "mm_hashes": {"image": ["beef"]}}
    assert cache.lookup(ids, media=media_items(other)) == 64  # the blocks before the image only

    index = PrefixIndex()
    KvEventMirror(index, "e", "m", 16).apply(events)
    seed = chain_seed("m")
    assert index.match(block_hashes(ids, 16, seed, media=prompt_media(features))) == {"e": 16}
    assert index.match(block_hashes(ids, 16, seed, media=prompt_media(other))) == {"e": 5}


def test_the_encode_leg_sends_only_images_it_can_encode_and_asks_for_one_step() -> None:
    """EPD: images whose pixels the request carries go to the encoder (an item render left to a cache,
    ``None``, cannot be encoded there); the encoder is asked for one non-streamed step with nothing
    else to compute, and the request the answering engine gets is left as it was."""
    from coordinator.pipeline.topology.encode import encode_body, media_hashes

    features = {"mm_hashes": {"image": ["a", "b"]}, "kwargs_data": {"image": ["px", None]},
                "mm_placeholders": {"image": [{"offset": 3, "length": 19}, {"offset": 30, "length": 19}]}}
    generate: Any = {"request_id": "r", "token_ids": [1] * 60, "features": features, "stream": True,
                     "sampling_params": {"max_tokens": 200, "n": 2, "logprobs": 3, "min_tokens": 5,
                                         "structured_outputs": {"json": {}}, "temperature": 0.7},
                     "kv_transfer_params": {"do_remote_decode": True}}
    assert media_hashes(generate) == ["a"]
    assert media_hashes({**generate, "features": None}) == [] and media_hashes({"request_id": "r"}) == []
    body = encode_body(generate)
    assert body["sampling_params"] == {"max_tokens": 1, "n": 1, "temperature": 0.7}
    assert body["stream"] is False and body["kv_transfer_params"] is None and body["features"] is features
    assert generate["sampling_params"]["max_tokens"] == 200 and generate["stream"] is True
