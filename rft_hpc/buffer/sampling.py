"""Sampling policies: the order in which a reader hands out the records it has discovered.

A pool holds `PoolItem`s (references to records, never the records themselves) and knows
only order: `pop()` gives the next item, `requeue()` puts back an item that may be replayed.
Staleness and the replay limit are applied by the reader on top of any pool. Every pool's
state is plain JSON, so the reader's cursor can be saved and restored exactly.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any, Protocol

from rft_hpc.config.buffer import FifoSampler, MixtureSampler, PrioritySampler, SamplerConfig


class PoolItem:
    """A reference to one record plus what the policies need to order it."""

    __slots__ = ("index", "priority", "segment", "seq", "taskset", "uses", "version", "writer")

    def __init__(self, writer: str, segment: int, index: int, *, uses: int = 0,
                 priority: float = 0.0, version: int | None = None, seq: int = 0,
                 taskset: str = "default") -> None:
        self.writer = writer
        self.segment = segment
        self.index = index
        self.uses = uses
        self.priority = priority
        self.version = version
        self.seq = seq
        self.taskset = taskset

    def to_json(self) -> list[Any]:
        return [self.writer, self.segment, self.index, self.uses, self.priority, self.version,
                self.seq, self.taskset]

    @classmethod
    def from_json(cls, v: list[Any]) -> PoolItem:
        w, s, i, uses, prio, version, seq, taskset = v
        return cls(w, s, i, uses=uses, priority=prio, version=version, seq=seq, taskset=taskset)


class Pool(Protocol):
    """Ordering of the records a reader has discovered but not used up."""

    def add(self, item: PoolItem) -> bool:
        """Take in a newly discovered item; False if this policy never hands it out."""

    def pop(self) -> PoolItem | None:
        """Remove and return the next item, or None if none is available."""

    def requeue(self, item: PoolItem) -> None:
        """Put back an item that was just handed out and may be handed out again."""

    def items(self) -> list[PoolItem]:
        """Every item held (any order)."""

    def __len__(self) -> int: ...

    def state(self) -> dict[str, Any]:
        """JSON-serializable state; `load_state` of it restores the exact order."""

    def load_state(self, state: dict[str, Any]) -> None: ...


class FifoPool:
    """Discovery order; replayed records go to the back."""

    def __init__(self, config: FifoSampler) -> None:
        self._q: deque[PoolItem] = deque()

    def add(self, item: PoolItem) -> bool:
        self._q.append(item)
        return True

    def pop(self) -> PoolItem | None:
        return self._q.popleft() if self._q else None

    def requeue(self, item: PoolItem) -> None:
        self._q.append(item)

    def items(self) -> list[PoolItem]:
        return list(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def state(self) -> dict[str, Any]:
        return {"items": [i.to_json() for i in self._q]}

    def load_state(self, state: dict[str, Any]) -> None:
        self._q = deque(PoolItem.from_json(v) for v in state["items"])


class PriorityPool:
    """Highest priority first, ties in discovery order; each reuse multiplies the priority."""

    def __init__(self, config: PrioritySampler) -> None:
        self.decay = config.reuse_decay
        self._heap: list[tuple[float, int, PoolItem]] = []
        self._seq = 0

    def _push(self, item: PoolItem) -> None:
        item.seq = self._seq
        self._seq += 1
        heapq.heappush(self._heap, (-item.priority, item.seq, item))

    def add(self, item: PoolItem) -> bool:
        self._push(item)
        return True

    def pop(self) -> PoolItem | None:
        return heapq.heappop(self._heap)[2] if self._heap else None

    def requeue(self, item: PoolItem) -> None:
        item.priority *= self.decay
        self._push(item)

    def items(self) -> list[PoolItem]:
        return [e[2] for e in self._heap]

    def __len__(self) -> int:
        return len(self._heap)

    def state(self) -> dict[str, Any]:
        return {"items": [e[2].to_json() for e in self._heap], "seq": self._seq}

    def load_state(self, state: dict[str, Any]) -> None:
        items = [PoolItem.from_json(v) for v in state["items"]]
        self._heap = [(-i.priority, i.seq, i) for i in items]
        heapq.heapify(self._heap)
        self._seq = state["seq"]


class MixturePool:
    """Task sets interleaved by smooth weighted round robin: deterministic, exact proportions.

    Only task sets that have records compete, so a task set that runs dry does not stall the
    others; its share goes to them until it has records again.
    """

    def __init__(self, config: MixtureSampler) -> None:
        self.weights = {k: v for k, v in config.weights.items() if v > 0}
        self._queues: dict[str, deque[PoolItem]] = {k: deque() for k in self.weights}
        self._credit: dict[str, float] = dict.fromkeys(self.weights, 0.0)

    def add(self, item: PoolItem) -> bool:
        q = self._queues.get(item.taskset)
        if q is None:
            return False
        q.append(item)
        return True

    def pop(self) -> PoolItem | None:
        ready = [k for k in sorted(self._queues) if self._queues[k]]
        if not ready:
            return None
        for k in ready:
            self._credit[k] += self.weights[k]
        pick = max(ready, key=lambda k: self._credit[k])
        self._credit[pick] -= sum(self.weights[k] for k in ready)
        return self._queues[pick].popleft()

    def requeue(self, item: PoolItem) -> None:
        self._queues[item.taskset].append(item)

    def items(self) -> list[PoolItem]:
        return [i for q in self._queues.values() for i in q]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def state(self) -> dict[str, Any]:
        return {"queues": {k: [i.to_json() for i in q] for k, q in self._queues.items()},
                "credit": dict(self._credit)}

    def load_state(self, state: dict[str, Any]) -> None:
        for k, items in state["queues"].items():
            if k in self._queues:
                self._queues[k] = deque(PoolItem.from_json(v) for v in items)
        for k, c in state["credit"].items():
            if k in self._credit:
                self._credit[k] = c


def state_items(state: dict[str, Any]) -> list[PoolItem]:
    """The items held in a saved pool state of any sampler (`Pool.state()`), any order."""
    raw = list(state.get("items", []))
    for queue in state.get("queues", {}).values():
        raw += queue
    return [PoolItem.from_json(v) for v in raw]


def build_pool(config: SamplerConfig) -> Pool:
    """The pool for a sampler config."""
    if isinstance(config, PrioritySampler):
        return PriorityPool(config)
    if isinstance(config, MixtureSampler):
        return MixturePool(config)
    return FifoPool(config)
