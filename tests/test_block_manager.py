"""The paged KV cache's block manager without a model: reference counts, the prefix cache and
its hash-collision checks, LRU eviction, OutOfPages atomicity, and a randomized run that checks
the invariants after every operation (plain ``random`` with fixed seeds: hypothesis is not a
dependency). The invariant checks read the manager's private structures on purpose."""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

import pytest

from service.engine.block_manager import BlockManager, HashFn, OutOfPages, chained_hash


def fits(bm: BlockManager, num_tokens: int) -> bool:
    """Whether ``allocate`` of ``num_tokens`` tokens succeeds even without a cache hit."""
    return bm.pages_needed(num_tokens) <= bm.num_free + bm.num_cached


def append(bm: BlockManager, seq: object) -> int:
    """One more position for ``seq`` (``grow`` by 1, as a decode step does): its flat slot."""
    bm.grow(seq, 1)
    pos = bm.num_tokens(seq) - 1
    return bm.page_table(seq)[pos // bm.page_size] * bm.page_size + pos % bm.page_size


def const_hash(parent: int | None, ids: tuple[int, ...]) -> int:
    """Every page collides with every other."""
    return 7


def parentless_hash(parent: int | None, ids: tuple[int, ...]) -> int:
    """Equal pages collide whatever precedes them (tuples of ints hash the same in every run)."""
    return hash(ids)


def snapshot(bm: BlockManager, seq_ids: Sequence[Hashable]) -> tuple:
    return (
        bm.num_free,
        bm.num_used,
        bm.num_cached,
        {s: (bm.page_table(s), bm.num_tokens(s)) for s in seq_ids},
        list(bm._free),
        list(bm._lru),
        dict(bm._by_hash),
        list(bm._refs),
        bm.queried_tokens,
        bm.hit_tokens,
    )


def test_pages_needed_and_bad_arguments() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    assert [bm.pages_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert fits(bm, 16) and not fits(bm, 17)
    with pytest.raises(ValueError):
        BlockManager(num_pages=0, page_size=4)
    with pytest.raises(ValueError):
        BlockManager(num_pages=4, page_size=0)
    with pytest.raises(ValueError):
        bm.allocate("a", [])
    bm.allocate("a", [1])
    with pytest.raises(ValueError):
        bm.allocate("a", [1])
    with pytest.raises(KeyError):
        bm.free("nobody")
    with pytest.raises(ValueError):
        bm.commit_full_pages("a", [1, 2])  # two ids, one position reserved


def test_default_hash_is_stable_and_chained() -> None:
    # Pinned values: the same in every process (Python's hash of bytes is randomized per process).
    assert chained_hash(None, (1, 2, 3)) == 13041116711478803063
    assert chained_hash(13041116711478803063, (4,)) == 6900099200373428577
    assert chained_hash(None, (1, 2, 3)) != chained_hash(chained_hash(None, (0,)), (1, 2, 3))
    assert chained_hash(None, (1, 2, 3)) != chained_hash(None, (1, 2, 4))
    assert 0 <= chained_hash(None, (1, 2, 3)) < 2**64


def test_two_sequences_sharing_a_prefix_count_references() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    alloc_a = bm.allocate("a", a)
    assert alloc_a.page_table == (0, 1, 2) and alloc_a.num_cached_tokens == 0
    assert bm.commit_full_pages("a", a) == 2  # pages 0 and 1 are full; page 2 holds one id

    b = [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    alloc_b = bm.allocate("b", b)
    assert alloc_b.page_table == (0, 1, 3) and alloc_b.num_cached_tokens == 8
    assert [bm.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    assert (bm.num_used, bm.num_cached, bm.num_free) == (4, 0, 4)

    bm.free("a")
    assert [bm.refcount(p) for p in range(4)] == [1, 1, 0, 1]
    assert (bm.num_used, bm.num_cached, bm.num_free) == (3, 0, 5)  # a's partial page is free at once
    bm.free("b")
    assert [bm.refcount(p) for p in range(4)] == [0, 0, 0, 0]
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 2, 6)  # the shared full pages stay cached


def test_freed_pages_are_cached_and_reused_by_an_identical_prompt() -> None:
    bm = BlockManager(num_pages=6, page_size=4)
    prompt = list(range(10, 20))  # 10 ids: two full pages and two ids
    first = bm.allocate("a", prompt)
    assert (bm.queried_tokens, bm.hit_tokens) == (10, 0)
    bm.commit_full_pages("a", prompt)
    bm.free("a")
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 2, 4)

    again = bm.allocate("b", prompt)
    assert again.num_cached_tokens == 8
    assert again.page_table[:2] == first.page_table[:2]
    assert (bm.queried_tokens, bm.hit_tokens) == (20, 8)
    assert (bm.num_used, bm.num_cached, bm.num_free) == (3, 0, 3)
    assert bm.commit_full_pages("b", prompt) == 0  # both full pages were already registered


def test_lru_evicts_the_oldest_and_a_hit_moves_a_page_to_the_back() -> None:
    bm = BlockManager(num_pages=5, page_size=4)
    prompts = {name: [tok] * 4 + [9] for name, tok in (("a", 1), ("b", 2), ("c", 3))}
    for name, prompt in prompts.items():  # freed in the order a, b, c
        bm.allocate(name, prompt)
        bm.commit_full_pages(name, prompt)
        bm.free(name)
    assert (bm.num_cached, bm.num_free) == (3, 2)

    hit = bm.allocate("d", [1, 1, 1, 1, 7])  # touches a's page: now the most recently used
    assert hit.num_cached_tokens == 4
    bm.free("d")
    assert (bm.queried_tokens, bm.hit_tokens) == (20, 4)

    bm.allocate("e", [5] * 12)  # three pages: the two free ones, then b's (the oldest) evicted
    assert [bm.match_prefix(prompts[n]).num_tokens for n in "abc"] == [4, 0, 4]
    assert (bm.num_cached, bm.num_free) == (2, 0)
    bm.allocate("f", [6] * 4)  # one more: c's goes, a's (touched by the hit) stays
    assert [bm.match_prefix(prompts[n]).num_tokens for n in "abc"] == [4, 0, 0]
    assert (bm.num_used, bm.num_cached, bm.num_free) == (4, 1, 0)


def test_a_sequences_deepest_page_is_evicted_before_its_prefix() -> None:
    bm = BlockManager(num_pages=4, page_size=2)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate("a", prompt)
    bm.commit_full_pages("a", prompt)
    bm.free("a")
    assert bm.match_prefix(prompt).num_tokens == 4
    bm.allocate("x", [9] * 6)  # two free pages, then one evicted: the second page, not the first
    assert bm.match_prefix(prompt).num_tokens == 2


def test_a_constant_hash_never_gives_a_false_hit() -> None:
    bm = BlockManager(num_pages=8, page_size=2, hash_fn=const_hash)
    a = [1, 2, 3, 4, 5]
    bm.allocate("a", a)
    # Page 0 takes the one hash; page 1's collides with it and page 0 is in use, so it stays out.
    assert bm.commit_full_pages("a", a) == 1
    assert bm.match_prefix([1, 2, 9, 9, 9]).num_tokens == 2  # a true hit: page 0's ids are equal
    assert bm.match_prefix([1, 2, 3, 4, 6]).num_tokens == 2  # page 1 was never registered
    assert bm.match_prefix([3, 4, 5]).num_tokens == 0  # the hash matches page 0, its ids do not
    c = bm.allocate("c", [3, 4, 5])
    assert c.num_cached_tokens == 0 and 0 not in c.page_table


def test_a_colliding_unreferenced_page_gives_way() -> None:
    bm = BlockManager(num_pages=4, page_size=2, hash_fn=const_hash)
    bm.allocate("a", [1, 2, 0])
    bm.commit_full_pages("a", [1, 2, 0])
    bm.free("a")
    assert (bm.num_cached, bm.match_prefix([1, 2, 0]).num_tokens) == (1, 2)
    bm.allocate("b", [5, 6, 0])
    assert bm.commit_full_pages("b", [5, 6, 0]) == 1  # a's cached page is dropped for b's
    assert [bm.match_prefix(p).num_tokens for p in ([1, 2, 0], [5, 6, 0])] == [0, 2]
    assert (bm.num_used, bm.num_cached, bm.num_free) == (2, 0, 2)


def test_equal_page_ids_after_another_prefix_are_no_hit() -> None:
    # The hash ignores the parent, so [7, 7 | 3, 4] and [1, 2 | 3, 4] collide at depth 1: only
    # the parent check tells them apart (a's page 1 holds K/V computed after [1, 2]).
    bm = BlockManager(num_pages=8, page_size=2, hash_fn=parentless_hash)
    bm.allocate("a", [1, 2, 3, 4, 0])
    assert bm.commit_full_pages("a", [1, 2, 3, 4, 0]) == 2
    bm.allocate("c", [7, 7, 3, 4, 0])
    assert bm.commit_full_pages("c", [7, 7, 3, 4, 0]) == 1
    assert bm.match_prefix([7, 7, 3, 4, 1]).num_tokens == 2
    assert bm.match_prefix([1, 2, 3, 4, 1]).num_tokens == 4


def test_a_prompt_of_whole_pages_leaves_its_last_page_to_compute() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    prompt = list(range(8))
    bm.allocate("a", prompt)
    assert bm.commit_full_pages("a", prompt) == 2
    bm.free("a")
    assert bm.num_cached == 2
    # Both pages are cached, but the step must compute the last prompt token's logits.
    assert bm.match_prefix(prompt).num_tokens == 4
    again = bm.allocate("b", prompt)
    assert again.num_cached_tokens == 4 and len(again.page_table) == 2
    # b rewrote page 1 itself: the cached copy hands b's page its registration and is freed.
    assert bm.commit_full_pages("b", prompt) == 1
    assert (bm.num_used, bm.num_cached, bm.num_free) == (2, 0, 6)
    assert bm.match_prefix([*prompt, 99]).pages == tuple(again.page_table)
    assert bm.match_prefix([*prompt, 99]).num_tokens == 8  # one more id: both pages match


def test_a_recomputed_page_takes_over_the_registration_and_keeps_its_children() -> None:
    bm = BlockManager(num_pages=8, page_size=2)
    a = [1, 2, 3, 4, 5]
    assert bm.allocate("a", a).page_table == (0, 1, 2)
    bm.commit_full_pages("a", a)
    bm.free("a")  # pages 0 ([1, 2]) and 1 ([3, 4] after [1, 2]) cached
    # [1, 2] is b's last page, so b computes it itself although page 0 holds the same K/V.
    assert bm.allocate("b", [1, 2]).page_table == (2,)
    assert bm.commit_full_pages("b", [1, 2]) == 1
    assert (bm.num_used, bm.num_cached, bm.num_free) == (1, 1, 6)  # page 0 freed, page 1 kept
    # Page 1 was registered after page 0's registration, which page 2 now holds: still a hit.
    assert bm.match_prefix(a).pages == (2, 1)


def test_out_of_pages_changes_nothing() -> None:
    bm = BlockManager(num_pages=3, page_size=4)
    a = [1, 2, 3, 4, 5]
    bm.allocate("a", a)
    bm.commit_full_pages("a", a)
    before = snapshot(bm, ["a"])
    with pytest.raises(OutOfPages):
        bm.allocate("b", list(range(9)))  # three pages, one free
    assert not fits(bm, 9)
    with pytest.raises(OutOfPages):
        bm.grow("a", 8)  # positions 5..12: two more pages
    assert snapshot(bm, ["a"]) == before

    bm.free("a")  # a's first page is cached, two free
    before = snapshot(bm, [])
    # The hit takes the cached page, so it cannot also be evicted for the 4 fresh pages needed.
    with pytest.raises(OutOfPages):
        bm.allocate("c", [1, 2, 3, 4, *range(20, 36)])
    assert snapshot(bm, []) == before
    assert "c" not in bm._seqs


def test_opting_out_neither_reads_nor_registers() -> None:
    bm = BlockManager(num_pages=8, page_size=4)
    prompt = list(range(9))
    bm.allocate("private", prompt, use_prefix_cache=False)
    assert bm.commit_full_pages("private", prompt) == 0
    bm.free("private")
    assert (bm.num_cached, bm.num_free, bm.queried_tokens) == (0, 8, 0)

    bm.allocate("shared", prompt)
    bm.commit_full_pages("shared", prompt)
    bm.free("shared")
    assert bm.num_cached == 2
    alone = bm.allocate("private", prompt, use_prefix_cache=False)
    assert alone.num_cached_tokens == 0
    assert not set(alone.page_table) & set(bm.match_prefix(prompt).pages)
    assert (bm.queried_tokens, bm.hit_tokens, bm.num_cached) == (9, 0, 2)


def test_a_cancelled_sequence_returns_its_pages_at_once() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    bm.allocate("cancelled", list(range(13)))  # all four pages, none committed
    assert bm.num_free == 0 and not fits(bm, 1)
    bm.free("cancelled")
    assert (bm.num_used, bm.num_cached, bm.num_free) == (0, 0, 4)
    assert bm.allocate("next", list(range(16))).page_table == (0, 1, 2, 3)  # the same pages, reused


def test_decode_growth_crosses_a_page_boundary() -> None:
    bm = BlockManager(num_pages=4, page_size=4)
    tokens = [1, 2, 3]
    assert bm.allocate("a", tokens).page_table == (0,)
    assert append(bm, "a") == 0 * 4 + 3  # fills page 0
    assert bm.page_table("a") == [0]
    assert append(bm, "a") == 1 * 4 + 0  # a new page for position 4
    assert bm.page_table("a") == [0, 1] and bm.num_tokens("a") == 5
    assert bm.grow("a", 0) == []
    assert bm.grow("a", 5) == [2]  # positions 5..9 end in page 2
    assert bm.num_tokens("a") == 10
    tokens += [4, 5, 6, 7, 8]  # page 1 now holds written ids 4..7
    assert bm.commit_full_pages("a", tokens) == 2
    assert bm.match_prefix([*tokens, 0]).num_tokens == 8

    full = BlockManager(num_pages=1, page_size=4)
    full.allocate("a", [1, 2, 3, 4])
    with pytest.raises(OutOfPages):
        append(full, "a")
    assert (full.num_tokens("a"), full.page_table("a")) == (4, [0])


# ---- randomized run ------------------------------------------------------------------------
class Model:
    """What the test knows independently: each live sequence's written ids, and the prefix whose
    K/V each page holds (set when a sequence commits the page)."""

    def __init__(self, bm: BlockManager, hash_fn: HashFn) -> None:
        self.bm = bm
        self.hash_fn = hash_fn
        self.tokens: dict[int, list[int]] = {}
        self.content: dict[int, tuple[int, ...]] = {}

    def commit(self, seq: int) -> None:
        ps = self.bm.page_size
        self.bm.commit_full_pages(seq, self.tokens[seq])
        for i, page in enumerate(self.bm.page_table(seq)[: len(self.tokens[seq]) // ps]):
            self.content[page] = tuple(self.tokens[seq][: (i + 1) * ps])

    def chain(self, prefix: tuple[int, ...]) -> int:
        ps, h = self.bm.page_size, None
        for i in range(0, len(prefix), ps):
            h = self.hash_fn(h, prefix[i : i + ps])
        assert h is not None
        return h

    def check(self) -> None:
        bm = self.bm
        free, cached = set(bm._free), set(bm._lru)
        used = {p for p in range(bm.num_pages) if bm._refs[p] > 0}
        assert len(free) == len(bm._free)  # no page twice on the free list
        assert not free & cached and not free & used and not cached & used
        assert free | cached | used == set(range(bm.num_pages))
        assert (bm.num_free, bm.num_cached, bm.num_used) == (len(free), len(cached), len(used))
        assert bm.num_free + bm.num_cached + bm.num_used == bm.num_pages
        holders = [0] * bm.num_pages
        for seq in self.tokens:
            table = bm.page_table(seq)
            assert len(table) == bm.pages_needed(bm.num_tokens(seq))
            for p in table:
                holders[p] += 1
        assert holders == bm._refs
        registered = [p for p in range(bm.num_pages) if bm._entries[p] is not None]
        assert cached <= set(registered) and not free & set(registered)
        assert len(bm._by_hash) == len(registered)
        for p in registered:
            entry = bm._entries[p]
            assert entry is not None and bm._by_hash[entry.hash] == p
            # The entry holds the ids the registering sequence wrote there, under their chained hash.
            assert entry.ids == self.content[p][-bm.page_size :]
            assert entry.hash == self.chain(self.content[p])

    def registered_prefixes(self) -> set[tuple[int, ...]]:
        return {self.content[p] for p in range(self.bm.num_pages) if self.bm._entries[p] is not None}


def expected_hit(model: Model, prompt: list[int]) -> int:
    """Tokens of the longest run of registered page prefixes of ``prompt``, last page excluded."""
    ps, have, n = model.bm.page_size, model.registered_prefixes(), 0
    while n + 1 <= (len(prompt) - 1) // ps and tuple(prompt[: (n + 1) * ps]) in have:
        n += 1
    return n * ps


@pytest.mark.parametrize(
    ("seed", "num_pages", "page_size", "hash_fn"),
    [
        (0, 12, 2, None),
        (1, 20, 3, None),
        (2, 12, 2, const_hash),
        (3, 16, 2, parentless_hash),
        (4, 16, 2, lambda parent, ids: (sum(ids) + (parent or 0)) % 5),
        (5, 2000, 2, None),  # never evicts: every registered prefix must be found
    ],
)
def test_random_operations_keep_the_invariants(
    seed: int, num_pages: int, page_size: int, hash_fn: HashFn | None
) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_pages, page_size, hash_fn=hash_fn)
    model = Model(bm, hash_fn or chained_hash)
    bases = [[rng.randrange(2) for _ in range(8)] for _ in range(3)]  # shared prefixes
    opted_out: set[int] = set()
    hits, min_free = 0, num_pages
    exact = hash_fn is None and num_pages >= 1000
    for step in range(600):
        op = rng.random()
        live = sorted(model.tokens)
        if op < 0.4 or not live:
            base = rng.choice(bases)
            prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(2) for _ in range(rng.randrange(6))]
            if not prompt:
                prompt = [1]
            use_cache = rng.random() < 0.85
            match = bm.match_prefix(prompt)
            taken = match.pages if use_cache else ()
            if exact:
                assert match.num_tokens == expected_hit(model, prompt)
            before = snapshot(bm, live)
            try:
                alloc = bm.allocate(step, prompt, use_prefix_cache=use_cache)
            except OutOfPages:
                fresh = bm.pages_needed(len(prompt)) - len(taken)
                assert fresh > bm.num_free + bm.num_cached - sum(bm._refs[p] == 0 for p in taken)
                assert snapshot(bm, live) == before
            else:
                cached = len(taken) * page_size
                assert alloc.num_cached_tokens == cached
                assert alloc.page_table[: len(taken)] == taken
                # No false hit: every matched page holds the K/V of the prompt's own prefix.
                for i, page in enumerate(alloc.page_table[: cached // page_size]):
                    assert model.content[page] == tuple(prompt[: (i + 1) * page_size])
                hits += cached > 0
                if not use_cache:
                    opted_out.add(step)
                # Chunked prefill: commit part of the prompt, then all of it.
                written = rng.randrange(cached, len(prompt) + 1)
                model.tokens[step] = list(prompt[:written])
                model.commit(step)
                model.tokens[step] = list(prompt)
                model.commit(step)
        elif op < 0.7:
            seq = rng.choice(live)
            before = snapshot(bm, live)
            n = rng.randrange(1, 4)
            try:
                if n == 1:
                    pos = bm.num_tokens(seq)
                    slot = append(bm, seq)
                    assert slot == bm.page_table(seq)[pos // page_size] * page_size + pos % page_size
                else:
                    bm.grow(seq, n)
            except OutOfPages:
                assert snapshot(bm, live) == before
            else:
                model.tokens[seq] += [rng.randrange(2) for _ in range(n)]
                model.commit(seq)
        else:
            seq = rng.choice(live)
            bm.free(seq)
            del model.tokens[seq]
        model.check()
        # An opted-out sequence's pages are its own and never registered.
        for seq in opted_out & set(model.tokens):
            assert all(bm._entries[p] is None and bm._refs[p] == 1 for p in bm.page_table(seq))
        min_free = min(min_free, bm.num_free)
    assert hits > 10  # the run did exercise the prefix cache
    if exact:
        assert min_free > 0  # the free list never ran out, so nothing was evicted
