"""The sidecar's parser-session cache: bounded by entries, bytes and idle time; take/put semantics.

The cache holds live vLLM parser objects, so what matters to a user is that it cannot grow past
its bounds however many streams come, and that a session is never handed to two calls.
"""

from __future__ import annotations

from render_sidecar.sessions import BYTES_FIXED, Session, SessionCache, estimate_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def session(rid: str, nbytes: int = 1000, index: int = 0) -> Session:
    return Session(key=(rid, index), parser=object(), detok=None, state=None, state_json=b"{}",
                   options_json=b"{}", chat_request=None, model=None, prompt_token_ids=[], nbytes=nbytes)


def test_least_recently_used_goes_first_when_entries_are_full() -> None:
    cache = SessionCache(max_entries=2, max_bytes=10**9, idle_ttl_s=60)
    for rid in ("a", "b"):
        cache.put(session(rid))
    cache.put(cache.take(("a", 0)) or session("never"))  # a was used again: b is now the oldest
    cache.put(session("c"))
    assert ("b", 0) not in cache and ("a", 0) in cache and ("c", 0) in cache
    assert cache.evictions["entries"] == 1 and len(cache) == 2


def test_resident_bytes_never_exceed_the_bound() -> None:
    cache = SessionCache(max_entries=1000, max_bytes=10_000, idle_ttl_s=60)
    for i in range(100):
        cache.put(session(f"s{i}", nbytes=900 + i))
        assert cache.resident_bytes <= 10_000
    assert cache.evictions["bytes"] > 0
    assert cache.resident_bytes == sum(900 + i for i in range(100) if (f"s{i}", 0) in cache)


def test_a_session_bigger_than_the_bound_is_not_kept() -> None:
    cache = SessionCache(max_entries=10, max_bytes=5_000, idle_ttl_s=60)
    cache.put(session("small", 1_000))
    cache.put(session("huge", 6_000))
    assert ("huge", 0) not in cache and ("small", 0) in cache and cache.resident_bytes == 1_000


def test_idle_sessions_expire() -> None:
    clock = Clock()
    cache = SessionCache(max_entries=10, max_bytes=10**9, idle_ttl_s=30, clock=clock)
    cache.put(session("old"))
    clock.now = 20
    cache.put(session("young"))
    clock.now = 35
    cache.expire()
    assert ("old", 0) not in cache and ("young", 0) in cache
    assert cache.evictions["idle"] == 1


def test_take_hands_a_session_out_once() -> None:
    cache = SessionCache(max_entries=10, max_bytes=10**9, idle_ttl_s=30)
    cache.put(session("s", 1234))
    first, second = cache.take(("s", 0)), cache.take(("s", 0))
    assert first is not None and second is None
    assert cache.resident_bytes == 0 and len(cache) == 0


def test_choices_of_one_request_are_separate_streams() -> None:
    cache = SessionCache(max_entries=10, max_bytes=10**9, idle_ttl_s=30)
    cache.put(session("r", index=0))
    cache.put(session("r", index=1))
    assert len(cache) == 2


def test_estimate_grows_with_what_a_session_holds() -> None:
    small = estimate_bytes(100, 10, 40, 200)
    assert small > BYTES_FIXED
    assert estimate_bytes(100_000, 10, 40, 200) > 100 * small  # a long agent prompt dominates
    assert estimate_bytes(100, 4_000, 16_000, 24_000) > estimate_bytes(100, 100, 400, 800)


def test_the_render_images_copy_every_module_the_server_imports() -> None:
    """The render images copy only the server's modules of render_sidecar/ and the coordinator's
    contracts package (no token_engine, no rest of the coordinator): whatever those import from the
    project must be among the copied files."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    shipped = {"__init__.py", "server.py", "stream_cache.py", "sessions.py", "prefix_hashes.py", "messages.py",
               "responses.py", "mm_placeholders.py", "media_fetch.py"}
    contracts = {p.stem for p in (root / "coordinator" / "contracts").glob("*.py")} - {"__init__"}
    for dockerfile in ("render.Dockerfile", "vllm-cpu.Dockerfile"):
        text = (root / "deploy" / "docker" / dockerfile).read_text()
        copied = set(re.findall(r"render_sidecar/(\w+\.py)", text))
        assert copied == shipped, dockerfile
        assert "COPY coordinator/contracts /opt/llmc/coordinator/contracts" in text, dockerfile
    project = ("render_sidecar", "token_engine", "coordinator", "perf", "deploy", "tests")
    for name in shipped - {"__init__.py"}:
        tree = ast.parse((root / "render_sidecar" / name).read_text())
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            for imported in names:
                if imported.split(".")[0] not in project:
                    continue
                if imported.startswith("coordinator."):
                    assert imported.split(".")[1] == "contracts" and imported.split(".")[-1] in contracts, \
                        f"{name} imports {imported}"
                else:
                    assert imported.startswith("render_sidecar.") and \
                        f"{imported.split('.')[-1]}.py" in shipped, f"{name} imports {imported}"
