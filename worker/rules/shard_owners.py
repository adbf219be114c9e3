"""Which live worker keeps each dedup gate shard, and how soon a gate hands one over (pure).

Every worker computes the owners from the names of the live workers it sees, with no coordination:
workers that see the same names agree. A shard goes to the name that ranks it highest (a hash of
shard and name, the same on every host), unless that name already has its share of the shards
(``shards // names``, and one more for the first ``shards % names`` to ask), then to the next:
rendezvous hashing with a bounded load, so with eight shards over three workers each keeps two or
three, and a worker that joins or leaves moves few shards besides its own.

Views differ for a moment while a worker joins or dies, so two gates may each believe another
owns a shard and hand it back and forth. ``HandoverPacing`` bounds that: a gate that hands over a
shard it handed over recently first keeps it twice as long as the time before.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Final

__all__ = ["HandoverPacing", "shard_owners"]

_HOLD_S: Final = (0.5, 30.0)  # the least a gate keeps a shard it became active on, and the most


def shard_owners(members: Collection[str], shards: int) -> dict[int, str]:
    """The owner of each shard ``0 .. shards - 1`` among ``members`` (none without members)."""
    if not members:
        return {}
    share, extra = divmod(shards, len(members))  # each keeps ``share``; ``extra`` of them one more
    load: Counter[str] = Counter()
    owners: dict[int, str] = {}
    for shard in range(shards):
        ranked = sorted(members, key=lambda name: (_rank(shard, name), name), reverse=True)
        owner = next(name for name in ranked if load[name] < share or (load[name] == share and extra))
        if load[owner] == share:
            extra -= 1
        owners[shard] = owner
        load[owner] += 1
    return owners


def _rank(shard: int, name: str) -> bytes:
    return hashlib.blake2b(f"{shard}\x00{name}".encode(), digest_size=8).digest()


@dataclass(frozen=True, slots=True)
class _Handed:
    at: float
    hold_s: float


@dataclass(slots=True)
class HandoverPacing:
    """How long a gate keeps a shard it is active on before handing it to its owner.

    ``hold_s`` is the first hold; handed over again within ``memory_s`` of the last time, the
    hold doubles, up to ``longest_s``.
    """

    hold_s: float = _HOLD_S[0]
    longest_s: float = _HOLD_S[1]
    memory_s: float = 60.0
    _last: dict[int, _Handed] = field(default_factory=dict)

    def hold(self, shard: int, now: float) -> float:
        """Seconds to keep ``shard`` after becoming its active gate, before handing it over."""
        last = self._last.get(shard)
        if last is None or now - last.at > self.memory_s:
            return self.hold_s
        return min(last.hold_s * 2, self.longest_s)

    def handed_over(self, shard: int, now: float) -> None:
        """``shard`` was handed over at ``now``."""
        self._last[shard] = _Handed(now, self.hold(shard, now))
