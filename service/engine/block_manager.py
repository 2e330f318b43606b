"""Pages of the paged KV cache: free list, reference counts and prefix caching.

Plain Python and no JAX, so it is testable without a model. The KV cache is ``num_pages`` pages
of ``page_size`` token positions each; a sequence's page table lists its pages in order, so
position ``i`` lives at slot ``page_table[i // page_size] * page_size + i % page_size``
(Kwon et al. 2023, "PagedAttention", §4.2 block tables, §4.4 reference counts for shared pages).

Prefix caching follows vLLM's "automatic prefix caching": a full page is named by a chained
hash, ``hash_fn(parent page's hash, this page's ids)``, so one hash covers the whole prefix up
to the page, and a new prompt walks its pages' hashes from the start. A hash hit is never
trusted alone: it counts only if the cached page's ids equal the prompt's page and its parent
registration is the one matched a page earlier (so a collision at any depth is caught; see
``_Entry``). Unreferenced cached pages are kept until free pages run out, then evicted least
recently used first, the deepest page of a sequence before its parents (SGLang's
RadixAttention, Zheng et al. 2024, §3, evicts leaves first for the same reason: a page whose
parent is gone can no longer be matched).

Every call costs O(pages it touches) dict/list operations, plus hashing and comparing those
pages' ids (slices, no per-token Python loop).
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

HashFn = Callable[[int | None, tuple[int, ...]], int]

_ROOT = 0  # the parent registration of a sequence's first page; real registrations count from 1


def chained_hash(parent: int | None, ids: tuple[int, ...]) -> int:
    """The default page hash: 64-bit BLAKE2b over the parent page's hash (8 bytes, none for a
    first page) and the page's ids as signed 64-bit integers.

    Stable across processes, unlike Python's ``hash`` of bytes (randomized per process). Raises
    OverflowError for an id outside the signed 64-bit range.
    """
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(array("q", ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class OutOfPages(Exception):
    """Not enough free and evictable pages; the manager's state is unchanged."""


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a prompt: its pages, in order, and the tokens they hold."""

    pages: tuple[int, ...]
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A new sequence's page table, and how many of its first tokens are already cached (their
    K/V need not be computed: prefill starts at ``num_cached_tokens``)."""

    page_table: tuple[int, ...]
    num_cached_tokens: int


@dataclasses.dataclass(frozen=True)
class _Entry:
    """What a cached page holds: its hash, its ids, and two registration numbers.

    ``reg`` is unique to this registration (never reused, even when the page is evicted and
    registered again), ``parent_reg`` the ``reg`` of the page before it (``_ROOT`` for a first
    page). A match at depth d requires ``parent_reg`` to equal the ``reg`` matched at depth
    d - 1, so by induction a matched chain's ids equal the prompt's whole prefix whatever the
    hashes do; a page id alone would not do, since the parent page may have been evicted and
    reused for another prefix since.
    """

    hash: int
    ids: tuple[int, ...]
    reg: int
    parent_reg: int


@dataclasses.dataclass
class _Seq:
    pages: list[int]
    num_tokens: int  # positions reserved: the page table has room for exactly these
    use_cache: bool
    committed: int = 0  # full pages already passed through the prefix cache
    last_hash: int | None = None  # chained hash of page committed - 1
    last_reg: int = _ROOT  # registration whose prefix equals this sequence's pages [0, committed)
    blocked: bool = False  # a collision stopped registration: no deeper page can be chained


class BlockManager:
    """Pages of one KV cache pool, shared by its sequences.

    Each page is exactly one of: free (on the free list, holds nothing), cached (reference
    count 0 but registered in the prefix cache, evictable) or used (reference count >= 1).

    Args:
        num_pages: pages in the pool, >= 1.
        page_size: token positions per page, >= 1.
        hash_fn: ``(parent hash or None, page ids) -> int``; defaults to ``chained_hash``.
            Injectable so a test can force collisions.

    Raises:
        ValueError: num_pages or page_size below 1.
    """

    def __init__(self, num_pages: int, page_size: int, hash_fn: HashFn | None = None):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._hash_fn: HashFn = hash_fn or chained_hash
        # Popped from the end, so a fresh manager hands out pages 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages, least recently used first
        self._refs: list[int] = [0] * num_pages
        self._entries: list[_Entry | None] = [None] * num_pages  # the registration a page holds
        self._by_hash: dict[int, int] = {}  # hash -> the one page registered under it
        self._seqs: dict[Hashable, _Seq] = {}
        self._next_reg = _ROOT + 1
        self.queried_tokens = 0  # prompt tokens of allocations that used the prefix cache
        self.hit_tokens = 0  # of those, tokens found cached

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages no sequence references but the prefix cache keeps (evictable)."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.num_pages - len(self._free) - len(self._lru)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` positions: ceil(num_tokens / page_size)."""
        return -(-num_tokens // self.page_size)

    def refcount(self, page: int) -> int:
        """Page tables holding ``page``."""
        return self._refs[page]

    def page_table(self, seq_id: Hashable) -> list[int]:
        """A copy of ``seq_id``'s page table. Raises KeyError for an unknown sequence."""
        return list(self._seq(seq_id).pages)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Positions reserved for ``seq_id`` (prompt plus grown). Raises KeyError when unknown."""
        return self._seq(seq_id).num_tokens

    # ---- the prefix cache --------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest run of cached full pages equal to a prefix of ``token_ids``.

        Pure: touches neither the LRU order nor the counters (``allocate`` does). The page
        holding the last prompt token is never matched, so at least one token is left to
        compute: prefill must produce the logits of the last prompt token to sample the first
        output id, and a fully cached prompt would give the step nothing to run (vLLM
        recomputes the last token for the same reason). O(matched pages x page_size).
        """
        pages, _, _ = self._match(token_ids)
        return PrefixMatch(pages=tuple(pages), num_tokens=len(pages) * self.page_size)

    def _match(self, token_ids: Sequence[int]) -> tuple[list[int], int | None, int]:
        """(matched pages, chained hash of the last one, its registration)."""
        ps = self.page_size
        pages: list[int] = []
        parent_hash: int | None = None
        parent_reg = _ROOT
        for i in range((len(token_ids) - 1) // ps):
            ids = tuple(token_ids[i * ps : (i + 1) * ps])
            h = self._hash_fn(parent_hash, ids)
            page = self._by_hash.get(h)
            if page is None:
                break
            entry = self._entries[page]
            assert entry is not None
            if entry.ids != ids or entry.parent_reg != parent_reg:
                break  # a collision, or a page whose parent registration was evicted since
            pages.append(page)
            parent_hash, parent_reg = h, entry.reg
        return pages, parent_hash, parent_reg

    def commit_full_pages(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Register ``seq_id``'s full pages written since the last call in the prefix cache.

        ``token_ids`` are the sequence's ids whose K/V are in its pages (prompt, then fed-back
        output ids), each call's extending the last's; only whole pages count. When the same
        prefix is already registered (another sequence computed it at the same time), an
        unreferenced holder hands its registration to this sequence's page and is freed (the
        K/V are the same, so pages cached under it stay matchable); a referenced holder keeps
        it, and this sequence's page stays private, returning to the free list when freed.
        When the hash names another prefix (a collision, or a page whose parent was evicted),
        an unreferenced holder is dropped for this page; a referenced one stops registration
        for this sequence, since no deeper page could be matched through an unregistered one.
        Does nothing for a sequence that opted out. O(new full pages x page_size).

        Returns:
            Pages this call registered.

        Raises:
            KeyError: unknown sequence.
            ValueError: more ids than the sequence has positions.
        """
        seq = self._seq(seq_id)
        if len(token_ids) > seq.num_tokens:
            raise ValueError(f"{len(token_ids)} ids but only {seq.num_tokens} positions reserved")
        ps = self.page_size
        full = len(token_ids) // ps
        if not seq.use_cache or seq.blocked:
            seq.committed = max(seq.committed, full)
            return 0
        registered = 0
        for i in range(seq.committed, full):
            ids = tuple(token_ids[i * ps : (i + 1) * ps])
            h = self._hash_fn(seq.last_hash, ids)
            holder = self._by_hash.get(h)
            held = self._entries[holder] if holder is not None else None
            same = held is not None and held.ids == ids and held.parent_reg == seq.last_reg
            if holder is not None and self._refs[holder] > 0:
                if not same:
                    seq.blocked = True
                    seq.committed = full
                    return registered
                assert held is not None
                entry = held  # this sequence's page stays private
            else:
                if holder is not None:
                    self._drop(holder)
                if held is not None and same:
                    entry = held  # the same K/V: this page takes the registration over
                else:
                    entry = _Entry(hash=h, ids=ids, reg=self._next_reg, parent_reg=seq.last_reg)
                    self._next_reg += 1
                self._register(seq.pages[i], entry)
                registered += 1
            seq.committed, seq.last_hash, seq.last_reg = i + 1, h, entry.reg
        return registered

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], use_prefix_cache: bool = True) -> Allocation:
        """Give a new sequence pages for its prompt: the matched cached pages (reference
        count + 1), then fresh ones, evicting cached pages when the free list runs out.

        With ``use_prefix_cache=False`` the cache is neither read here nor written by
        ``commit_full_pages`` (and the counters are not touched). O(prompt pages), plus the
        match.

        Raises:
            ValueError: ``seq_id`` already allocated, or no ids.
            OutOfPages: not enough free + evictable pages; nothing changed.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has pages")
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        matched, last_hash, last_reg = self._match(token_ids) if use_prefix_cache else ([], None, _ROOT)
        fresh = self.pages_needed(len(token_ids)) - len(matched)
        # Matched pages that sit in the LRU stop being evictable once this sequence holds them.
        evictable = len(self._lru) - sum(1 for p in matched if self._refs[p] == 0)
        if fresh > len(self._free) + evictable:
            raise OutOfPages(
                f"{len(token_ids)} tokens need {fresh} new pages of {self.page_size}; "
                f"{len(self._free)} free, {evictable} evictable"
            )
        for p in matched:
            if self._refs[p] == 0:
                del self._lru[p]
            self._refs[p] += 1
        pages = matched + self._take(fresh)
        self._seqs[seq_id] = _Seq(
            pages=pages,
            num_tokens=len(token_ids),
            use_cache=use_prefix_cache,
            committed=len(matched),
            last_hash=last_hash,
            last_reg=last_reg,
        )
        cached = len(matched) * self.page_size
        if use_prefix_cache:
            self.queried_tokens += len(token_ids)
            self.hit_tokens += cached
        return Allocation(page_table=tuple(pages), num_cached_tokens=cached)

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Reserve ``num_tokens`` more positions for ``seq_id`` (decode tokens), adding pages
        when the last one fills up. O(new pages).

        Returns:
            The pages added (often none).

        Raises:
            KeyError: unknown sequence.
            ValueError: num_tokens below 0.
            OutOfPages: not enough free + evictable pages; nothing changed.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        seq = self._seq(seq_id)
        need = self.pages_needed(seq.num_tokens + num_tokens) - len(seq.pages)
        if need > len(self._free) + len(self._lru):
            raise OutOfPages(
                f"{num_tokens} more tokens need {need} new pages; {len(self._free)} free, {len(self._lru)} evictable"
            )
        added = self._take(need)
        seq.pages += added
        seq.num_tokens += num_tokens
        return added

    def shrink(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Give back ``seq_id``'s positions from ``num_tokens`` on (the rejected draft ids of
        speculative decoding): pages past the one holding position ``num_tokens - 1`` go as
        ``free`` returns them. Pages already registered in the prefix cache are never past it
        (only known ids are committed). O(pages returned).

        Returns:
            The pages given back.

        Raises:
            KeyError: unknown sequence.
            ValueError: ``num_tokens`` outside [committed pages' tokens, reserved positions].
        """
        seq = self._seq(seq_id)
        if not seq.committed * self.page_size <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"cannot shrink a sequence of {seq.num_tokens} positions ({seq.committed} pages committed) "
                f"to {num_tokens}"
            )
        keep = self.pages_needed(num_tokens)
        dropped = seq.pages[keep:]
        del seq.pages[keep:]
        seq.num_tokens = num_tokens
        self._unref(dropped)
        return dropped

    def free(self, seq_id: Hashable) -> None:
        """Return a finished or cancelled sequence's pages at once: reference count - 1 on each;
        a page no longer referenced becomes cached if registered (most recently used), else
        free. The last page goes first, so a sequence's deepest pages are evicted before the
        prefixes they extend. O(pages). Raises KeyError for an unknown sequence."""
        self._unref(self._seqs.pop(seq_id).pages)

    def _unref(self, pages: list[int]) -> None:
        """Reference count - 1 on each of ``pages``, the last first; one no longer referenced
        becomes cached if registered (most recently used), else free."""
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._entries[page] is not None:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    # ---- internals ---------------------------------------------------------------------------
    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _register(self, page: int, entry: _Entry) -> None:
        self._entries[page] = entry
        self._by_hash[entry.hash] = page

    def _drop(self, page: int) -> None:
        """Move a cached page to the free list, its hash entry dropped."""
        del self._lru[page]
        self._unregister(page)
        self._free.append(page)

    def _unregister(self, page: int) -> None:
        entry = self._entries[page]
        assert entry is not None
        del self._by_hash[entry.hash]
        self._entries[page] = None

    def _take(self, n: int) -> list[int]:
        """``n`` pages, each given reference count 1: free ones first, then evicted ones (least
        recently used first, their hash entries dropped). The caller checked there are enough."""
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                self._unregister(page)
            self._refs[page] = 1
            pages.append(page)
        return pages
