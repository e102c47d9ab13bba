"""Block hashing and the engine → blocks index behind KV-affinity."""

from __future__ import annotations

import copy
import itertools
import random
import subprocess
import sys
from typing import Any

import pytest

from coordinator.contracts.hashing import block_hashes, chain_seed, next_hash
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
    code = ("from coordinator.contracts.hashing import block_hashes, chain_seed;"
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


def test_lru_capacity_evicts_oldest_blocks_tail_first() -> None:
    """What an engine keeps of an old prompt is its leading run, which still matches: evicting the
    head first (plain insertion order) would keep blocks no prompt can ever reach."""
    idx = PrefixIndex(capacity_blocks=4)
    a = block_hashes(list(range(64)), 16, SEED)           # 4 blocks
    b = block_hashes([3] * 32, 16, SEED)                  # 2 blocks
    idx.add("e1", a)
    idx.add("e1", b)
    assert idx.blocks("e1") == 4
    assert idx.match(a) == {"e1": 2}                       # a's last two blocks were evicted
    assert idx.match(b) == {"e1": 2}
    idx.add("e1", a[:1])                                   # touching a's head keeps it over b's
    idx.add("e1", block_hashes([4] * 48, 16, SEED))
    assert idx.match(a) == {"e1": 1} and idx.match(b) == {}


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


def test_bulk_hashes_equal_the_block_by_block_chain() -> None:
    """The one-pass hash is the chain ``next_hash`` defines, on random prompts and block sizes, and
    continuing a chain from a block's hash and depth gives the same hashes as hashing it whole."""
    rng = random.Random(5)
    for _ in range(200):
        bs = rng.choice([1, 2, 3, 7, 16, 32, 128])
        ids = [rng.randrange(200_000) for _ in range(rng.randrange(0, 12 * bs))]
        seed = chain_seed(rng.choice(["m", "m2"]), rng.choice([None, "salt"]))
        ref, parent = [], seed
        for depth in range(len(ids) // bs):
            parent = next_hash(parent, depth, ids[depth * bs:(depth + 1) * bs])
            ref.append(parent)
        assert block_hashes(ids, bs, seed) == ref
        if len(ref) > 2:
            cut = rng.randrange(1, len(ref))
            assert block_hashes(ids[cut * bs:], bs, ref[cut - 1], start=cut) == ref[cut:]


def test_the_c_chain_is_built_and_equals_the_python_form_bit_for_bit() -> None:
    """``make test`` builds the C loop (a broken build would silently fall back to Python, 3-7x slower
    at the intake); it must give the Python form's hashes for every int a token list can hold: token
    ids, negatives, -1 (whose hash is -2), ints past 2**61 - 1 and 2**64, int subclasses, numpy ints."""
    import numpy as np

    from coordinator.contracts import hashing

    assert hashing.NATIVE_CHAIN, "coordinator.contracts._chain was not built (is a C compiler installed?)"

    class Token(int):
        pass

    rng = random.Random(11)
    odd = [-1, -2, 0, 2**61 - 2, 2**61 - 1, 2**61, 2**63, 2**64 + 3, -(2**70), True, Token(9), np.int64(7)]
    for _ in range(500):
        bs = rng.choice([1, 2, 3, 16, 128])
        ids = [rng.choice([rng.randrange(50_000), rng.choice(odd)]) for _ in range(rng.randrange(0, 6 * bs))]
        seed, start = rng.randrange(-(2**63), 2**63), rng.randrange(0, 10_000)
        assert block_hashes(ids, bs, seed, start) == hashing._block_hashes(ids, bs, seed, start)
    ids = list(range(4096))
    assert block_hashes(np.array(ids), 16, SEED) == hashing._block_hashes(ids, 16, SEED)


def test_order_of_blocks_counts() -> None:
    a, b = [1] * 16, [2] * 16
    assert block_hashes(a + b, 16, SEED)[1] != block_hashes(b + a, 16, SEED)[1]


def _walk(idx: PrefixIndex, hashes: list[int]) -> dict[str, int]:
    """The definition ``match`` implements: per engine, the leading blocks it holds."""
    out: dict[str, int] = {}
    lrus = idx.state()[0]
    for engine in idx.engines():
        held = dict(lrus[engine])
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        if n:
            out[engine] = n
    return out


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_galloping_match_equals_a_block_by_block_walk(native: bool) -> None:
    """Random conversations learned on random engines under a small capacity (so trimming runs all
    the time): every engine keeps leading runs, and the O(log n) match finds exactly them."""
    rng = random.Random(11)
    idx = PrefixIndex(capacity_blocks=300, native=native)
    engines = [f"e{i}" for i in range(6)]
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(16, 200))] for _ in range(4)]
    convs: list[list[int]] = []
    chains: list[list[int]] = []
    for step in range(600):
        if convs and rng.random() < 0.6:
            base = rng.choice(convs)
            keep = base[:rng.randrange(len(base) + 1)]
            prompt = keep + [rng.randrange(1000) for _ in range(rng.randrange(200))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(400))]
        convs.append(prompt)
        hashes = block_hashes(prompt, 16, SEED)
        assert idx.match(hashes) == _walk(idx, hashes), step
        lo = rng.randrange(len(hashes) + 1)
        for engine in engines:   # on from any depth: the first one past it the engine does not hold
            held = {h for h, _ in idx.state()[0].get(engine, ())}
            end = next((d for d in range(lo, len(hashes)) if hashes[d] not in held), len(hashes))
            assert idx.run_from(engine, hashes, lo) == (end if lo < len(hashes) and hashes[lo] in held else lo)
        idx.add(rng.choice(engines), hashes)
        chains.append(hashes)
    assert all(0 < idx.blocks(e) <= 300 for e in engines)
    # Ownership is exactly who holds a block, and an indexed block's parent is marked continued.
    lrus, owners, _, shared_count = idx.state()
    held = {e: {h for h, _ in lrus[e]} for e in engines}
    every = set().union(*held.values())
    assert set(owners) == every
    assert all(idx.owners(h) == {e for e in engines if h in held[e]} for h in every)
    shared = [o for o in owners.values() if isinstance(o, tuple)]
    assert len(shared) == shared_count > 0 and all(len(set(o)) == len(o) > 1 for o in shared)   # one owner: a name
    for hashes in chains:
        for parent, child in itertools.pairwise(hashes):
            if child in owners and parent in owners:
                assert not idx.continues(parent)


def test_only_blocks_new_to_the_index_mark_their_parent_continued() -> None:
    idx = PrefixIndex()
    a = block_hashes(list(range(64)), 16, SEED)
    idx.add("e1", a[:2])
    assert idx.continues(a[1]) and not idx.continues(a[0])
    idx.add("e2", a)                 # a[2] is new: a[1] is now a branch point, a[3] a leaf
    assert not idx.continues(a[1]) and idx.continues(a[3])
    idx.remove("e2", a[2:])
    assert idx.continues(a[1]) is False  # a flag: stays until the block itself goes
    idx.clear("e1")
    idx.remove("e2", a[:2])
    assert idx.continues(a[1]) and idx.approx_bytes() > 0


@pytest.mark.parametrize("ttl", [None, 6], ids=["capacity", "ttl"])
def test_the_native_index_holds_exactly_what_the_python_form_holds(ttl: int | None) -> None:
    """The storage in C (``_index.c``: hash tables of machine words) against the Python form on the same
    random history: conversations on shared system prompts learned on random engines, re-learned (moves
    in the LRU), chains with repeated hashes and with a parent, removals of random runs and of blocks
    never held, trimming, expiry, clears. After every step both hold the same blocks in the same LRU
    order with the same last use, the same owners in the same order, leaves and shared count, and both
    match, continue and count alike."""
    from coordinator.pipeline.scheduling.prefix import index as module

    assert module.NATIVE_INDEX, "the _index extension was not built (is a C compiler installed?)"
    rng = random.Random(23)
    ticks = [itertools.count(), itertools.count()]
    engines = [f"e{i}" for i in range(5)]
    systems = [block_hashes([rng.randrange(1000) for _ in range(rng.randrange(16, 160))], 16, SEED)
               for _ in range(3)]
    capacity = 120
    pair = [PrefixIndex(capacity_blocks=capacity, ttl_s=ttl, native=native,
                        clock=lambda t=t: next(t) // 2)   # type: ignore[misc]
            for native, t in ((True, ticks[0]), (False, ticks[1]))]
    history: list[list[int]] = []
    most_shared = 0
    for step in range(1200):
        roll = rng.random()
        engine = rng.choice(engines)
        if roll < 0.55 or not history:
            base = rng.choice(history + systems)
            hashes = base[:rng.randrange(len(base) + 1)] + [rng.randrange(-(2**63), 2**63)
                                                             for _ in range(rng.randrange(12))]
            if rng.random() < 0.1 and hashes:
                hashes = [*hashes, rng.choice(hashes)]           # a hash twice in one chain
            parent = rng.choice([None, rng.randrange(2**40)]) if rng.random() < 0.2 else None
            history.append(hashes)
            op: tuple[Any, ...] = ("add", engine, hashes, parent)
        elif roll < 0.9:
            held = [h for h, _ in pair[0].state()[0].get(engine, ())]
            gone = [*rng.sample(held, min(len(held), rng.randrange(8))), rng.randrange(2**40)]
            op = ("remove", engine, gone, rng.random() < 0.5)   # as a list, or as an iterator
        else:
            op = ("clear", engine, None, None)
        probe = rng.choice(history + systems)
        for idx in pair:
            kind, e, hashes, parent = op
            if kind == "add":
                idx.add(e, hashes, parent=parent)
            elif kind == "remove":
                idx.remove(e, iter(hashes) if parent else hashes)
            else:
                idx.clear(e)
        c, py = pair
        assert c.state() == py.state(), step
        assert c.match(probe) == py.match(probe), step    # both tick their clock: expiry runs alike
        lo = rng.randrange(len(probe) + 1)
        assert [c.run_from(e, probe, lo) for e in engines] == [py.run_from(e, probe, lo) for e in engines], step
        assert c.engines() == py.engines() and [c.blocks(e) for e in engines] == [py.blocks(e) for e in engines]
        assert [c.continues(h) for h in probe] == [py.continues(h) for h in probe], step
        assert all(c.owners(h) == py.owners(h) for h in probe), step
        most_shared = max(most_shared, c.state()[3])
    assert c.native and not py.native and most_shared > 1
    clone, before = copy.deepcopy(c), c.state()   # a copy is whole and independent
    assert clone.state() == before
    for e in engines:
        clone.clear(e)
    assert c.state() == before and clone.engines() == []


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "none"


@pytest.mark.skipif(not PrefixIndex().native, reason="the C index is not built")
@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="the kernel gives no transparent huge pages")
def test_the_index_tables_sit_on_huge_pages_unless_told_not_to() -> None:
    """``scheduling.prefix.huge_pages``: an index of 400k blocks (tens of MiB of tables) is backed by
    transparent huge pages (the process's ``AnonHugePages`` grows by most of its tables); with
    ``huge_pages=False``, on a kernel that gives them only where asked (``madvise``), it is not."""
    code = ("import sys\n"
            "from coordinator.pipeline.scheduling.prefix.index import PrefixIndex\n"
            "def huge():\n"
            "    for line in open('/proc/self/smaps_rollup'):\n"
            "        if line.startswith('AnonHugePages:'): return int(line.split()[1]) // 1024\n"
            "before = huge()\n"
            "ix = PrefixIndex(huge_pages=sys.argv[1] == '1')\n"
            "for e in range(8):\n"
            "    for k in range(0, 50_000, 1000):\n"
            "        ix.add(f'e{e}', list(range(e * 10**9 + k, e * 10**9 + k + 1000)))\n"
            "print(huge() - before)\n")

    def grown_mib(huge_pages: bool) -> int:
        out = subprocess.run([sys.executable, "-c", code, "1" if huge_pages else "0"], capture_output=True,
                             text=True, check=True, timeout=300)
        return int(out.stdout.split()[-1])

    assert grown_mib(True) >= 16   # of ~44 MiB of tables (nodes 16, slots 8, owners 24; 2 MiB pages)
    if _thp_mode() == "madvise":
        assert grown_mib(False) < 4
