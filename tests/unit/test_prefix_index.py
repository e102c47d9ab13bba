"""Block hashing and the engine → blocks index behind KV-affinity."""

from __future__ import annotations

import subprocess
import sys

from coordinator.pipeline.scheduling.prefix.hashing import block_hashes, chain_seed
from coordinator.pipeline.scheduling.prefix.index import PrefixIndex

SEED = chain_seed("m")


def test_only_full_blocks_are_hashed_and_chained() -> None:
    ids = list(range(40))
    hs = block_hashes(ids, 16, SEED)
    assert len(hs) == 2  # 8 trailing tokens never form a cached block
    # Same second block after a different first block → different hash (the whole prefix counts).
    other = block_hashes([999] * 16 + ids[16:32], 16, SEED)
    assert hs[1] != other[1]
    assert block_hashes(ids[:32], 16, SEED) == hs


def test_model_and_salt_separate_hash_spaces() -> None:
    ids = list(range(32))
    base = block_hashes(ids, 16, chain_seed("m"))
    assert block_hashes(ids, 16, chain_seed("m2")) != base
    assert block_hashes(ids, 16, chain_seed("m", "tenant-a")) != base
    assert block_hashes(ids, 16, chain_seed("m", None)) == base


def test_hashes_agree_across_processes() -> None:
    """Replicas and restarts must compute the same hashes (str hashing is randomised per process)."""
    code = ("from coordinator.pipeline.scheduling.prefix.hashing import block_hashes, chain_seed;"
            "print(block_hashes(list(range(64)), 16, chain_seed('m', 's')))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip() == str(block_hashes(list(range(64)), 16, chain_seed("m", "s")))


def test_match_counts_leading_blocks_per_engine() -> None:
    idx = PrefixIndex()
    a = block_hashes(list(range(160)), 16, SEED)          # 10 blocks
    b = block_hashes(list(range(80)) + [7] * 80, 16, SEED)  # shares the first 5 blocks with a
    idx.add("e1", a)
    idx.add("e2", b)
    assert idx.match(a) == {"e1": 10, "e2": 5}
    assert idx.match(b) == {"e1": 5, "e2": 10}
    assert idx.match(block_hashes([5] * 160, 16, SEED)) == {}
    assert idx.match([]) == {}


def test_a_hole_in_the_chain_stops_the_match() -> None:
    idx = PrefixIndex()
    a = block_hashes(list(range(64)), 16, SEED)
    idx.add("e1", a)
    idx.remove("e1", [a[1]])
    assert idx.match(a) == {"e1": 1}


def test_lru_capacity_evicts_oldest_blocks() -> None:
    idx = PrefixIndex(capacity_blocks=4)
    a = block_hashes(list(range(64)), 16, SEED)           # 4 blocks
    b = block_hashes([3] * 32, 16, SEED)                  # 2 blocks
    idx.add("e1", a)
    idx.add("e1", b)
    assert idx.blocks("e1") == 4
    assert idx.match(a) == {}                              # a's first two blocks were evicted
    assert idx.match(b) == {"e1": 2}


def test_ttl_forgets_unused_blocks() -> None:
    now = [0.0]
    idx = PrefixIndex(ttl_s=10, clock=lambda: now[0])
    a = block_hashes(list(range(64)), 16, SEED)
    idx.add("e1", a)
    now[0] = 5
    assert idx.match(a) == {"e1": 4}
    now[0] = 11
    assert idx.match(a) == {}
    idx.add("e1", a[:1])                                   # touching trims the expired rest
    assert idx.blocks("e1") == 1


def test_clear_and_remove_drop_ownership() -> None:
    idx = PrefixIndex()
    a = block_hashes(list(range(64)), 16, SEED)
    idx.add("e1", a)
    idx.add("e2", a)
    idx.clear("e1")
    assert idx.match(a) == {"e2": 4}
    idx.remove("e2", a)
    assert idx.match(a) == {}
    assert idx.blocks("e2") == 0
