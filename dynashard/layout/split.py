"""How one dim is cut across ranks: a :class:`Split` (whole units per component, dealt out balanced).

A ``Split`` is arithmetic on sizes alone, the same on every rank: which elements each rank holds
(:meth:`Split.pieces`, :meth:`Split.owned`), how a cut changes when a rule asks for coarser units or
more components (:meth:`Split.coarsen`, :meth:`Split.cut`, :meth:`Split.keep_whole`), and the cut of a
concatenation (:func:`joined`). The plan chooses splits, the layout map carries them (``shard.py``),
the store cuts weights by them (``weights/store.py``), checkpoints read by them.

Invariants: a ``Split`` never changes (frozen); every rank computes the same pieces from it; origins
(the colwise linears' outputs) are always dealt balanced, only pieces carved out of them have ``deals``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Split:
    """How one dim is cut across ranks; the same on every rank.

    The dim holds ``len(parts)`` components side by side (a fused ``[q | k | v]`` has three);
    component ``i`` is ``parts[i]`` units of ``unit`` elements (a head: ``head_dim`` features).
    Each component's units are dealt out balanced, the first ranks taking one more: 6 heads on
    4 ranks are 2/2/1/1. A dim whose size is a multiple of :attr:`size` (a batch dim merged in
    front, ``[B * H]``) repeats the pattern for every outer index. Components listed in
    ``whole`` are held whole by every rank (a fused [q | k | v] with fewer KV heads than ranks:
    q is cut, k and v are not).

    ``deals`` (units per rank, per component) overrides the balanced deal. Only pieces carved out
    of a cut value have one (``q.split(1, dim=heads)``: each one-head piece is held by the rank that
    held that head, the others hold none of it); within a component ranks still hold consecutive
    ranges in rank order, so gathers and ``owned`` work unchanged. Origins are always balanced.
    """

    parts: tuple[int, ...]
    unit: int = 1
    whole: frozenset[int] = frozenset()
    deals: tuple[tuple[int, ...], ...] | None = None

    @property
    def size(self) -> int:
        return sum(self.parts) * self.unit

    def counts(self, world: int) -> list[list[int]]:
        """Units per component per rank."""
        if self.deals is not None:
            return [list(d) for d in self.deals]
        return [[p] * world if i in self.whole else [p // world + (r < p % world) for r in range(world)]
                for i, p in enumerate(self.parts)]

    def pieces(self, world: int, rank: int) -> list[tuple[int, int]]:
        """``(start, length)`` in elements of the dim, per component, for ``rank``."""
        out, offset = [], 0
        for i, (p, counts) in enumerate(zip(self.parts, self.counts(world))):
            before = 0 if i in self.whole else sum(counts[:rank])
            out.append(((offset + before) * self.unit, counts[rank] * self.unit))
            offset += p
        return out

    def sub(self, i: int, j: int) -> Split | None:
        """Components ``[i, j)`` alone; None when all of them are whole (a replicated value)."""
        if all(c in self.whole for c in range(i, j)):
            return None
        deals = None if self.deals is None else self.deals[i:j]
        return Split(self.parts[i:j], self.unit, frozenset(c - i for c in self.whole if i <= c < j), deals)

    def local(self, world: int, rank: int) -> int:
        return sum(length for _, length in self.pieces(world, rank))

    def lengths(self, world: int) -> list[list[int]]:
        """Elements per component per rank."""
        return [[c * self.unit for c in counts] for counts in self.counts(world)]

    def owned(self, world: int) -> list[list[tuple[int, int]]]:
        """Per rank, the element ranges ``[start, end)`` it holds, adjacent ones merged."""
        out = []
        for rank in range(world):
            ranges: list[tuple[int, int]] = []
            for start, length in self.pieces(world, rank):
                if ranges and ranges[-1][1] == start:
                    ranges[-1] = (ranges[-1][0], start + length)
                elif length:
                    ranges.append((start, start + length))
            out.append(ranges)
        return out

    def fewest_units(self, world: int) -> int:
        """The fewest units any rank holds of any component (0: some rank holds nothing)."""
        if self.deals is not None:
            return min(min(d) for d in self.deals)
        return min(p if i in self.whole else p // world for i, p in enumerate(self.parts))

    def coarsen(self, k: int) -> Split | None:
        """Units ``k`` times larger (``None`` when a component, or a rank's deal, is not a whole
        number of them)."""
        if any(p % k for p in self.parts) or any(c % k for d in self.deals or () for c in d):
            return None
        deals = None if self.deals is None else tuple(tuple(c // k for c in d) for d in self.deals)
        return Split(tuple(p // k for p in self.parts), self.unit * k, self.whole, deals)

    def refine(self, k: int) -> Split | None:
        """One balanced component in units ``k`` times smaller (None for any other split)."""
        if len(self.parts) != 1 or self.whole or self.deals is not None or self.unit % k:
            return None
        return Split((self.parts[0] * k,), self.unit // k)

    def regrouped(self, unit: int) -> Split:
        """The same components and deal, in units of ``unit`` elements (a view regrouping dims)."""
        return dataclasses.replace(self, unit=unit)

    def carve(self, edges: list[int], world: int) -> list[Split] | None:
        """This single cut component taken apart at unit offsets ``edges`` (first 0, last all units),
        every rank keeping exactly the units it held: piece ``[a, b)`` is dealt ``overlap([a, b),
        rank's range)`` per rank. None for a fused or whole split."""
        if len(self.parts) != 1 or self.whole:
            return None
        counts = self.counts(world)[0]
        ranges = [(sum(counts[:r]), sum(counts[: r + 1])) for r in range(world)]
        return [Split((b - a,), self.unit, deals=(tuple(max(0, min(b, e) - max(a, s)) for s, e in ranges),))
                for a, b in zip(edges, edges[1:])]

    def cut(self, boundaries: set[int]) -> Split:
        """Components also split at these unit offsets (the pieces of a whole one stay whole)."""
        assert self.deals is None, "only origins are re-cut, and origins are dealt balanced"
        parts, whole, offset = [], set(), 0
        for i, p in enumerate(self.parts):
            inner = sorted(b - offset for b in boundaries if offset < b < offset + p)
            edges = [0, *inner, p]
            for a, b in zip(edges, edges[1:]):
                if i in self.whole:
                    whole.add(len(parts))
                parts.append(b - a)
            offset += p
        return Split(tuple(parts), self.unit, frozenset(whole))

    def boundaries(self) -> set[int]:
        """Element offsets where one component ends and the next begins."""
        ends = [sum(self.parts[: i + 1]) * self.unit for i in range(len(self.parts))]
        return set(ends[:-1])

    def empties_a_rank(self, new: Split, world: int) -> bool:
        """Components are dealt out one by one, the first ranks taking each one's extra units: cutting
        a dim into components smaller than the world (``q.split(1, dim=heads)``: 4 one-head pieces on
        2 ranks) would give rank 0 every piece and leave another rank nothing it held before."""
        return any(new.local(world, r) == 0 < self.local(world, r) for r in range(world))

    def keep_whole(self, world: int) -> Split | None:
        """The components with fewer units than ranks held whole by every rank, the rest still
        cut; None if that leaves nothing cut or nothing whole."""
        small = frozenset(i for i, p in enumerate(self.parts) if p < world) | self.whole
        if small == self.whole or len(small) == len(self.parts):
            return None
        return Split(self.parts, self.unit, small)


def even(size: int) -> Split:
    return Split((size,), 1)


def joined(splits: list[Split], world: int) -> Split | None:
    """The split of a concatenation along the cut dim: the components side by side (each rank's
    local tensor is its pieces side by side, so ``cat`` of local tensors is this rank's part).
    Returned balanced when every rank holds the same elements as under a balanced single
    component (pieces carved out and put back in order). None for mixed units or whole parts."""
    if len({s.unit for s in splits}) != 1 or any(s.whole for s in splits):
        return None
    parts = tuple(p for s in splits for p in s.parts)
    deals = tuple(tuple(c) for s in splits for c in s.counts(world))
    out = Split(parts, splits[0].unit, deals=deals)
    balanced = Split((sum(parts),), splits[0].unit)
    return balanced if out.owned(world) == balanced.owned(world) else out


def shard_bounds(size: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank's part of an evenly split ``size``."""
    return even(size).pieces(world, rank)[0]
