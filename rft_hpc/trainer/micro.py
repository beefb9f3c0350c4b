"""Micro-batches packed to a token budget, and the records too long for any of them.

A rank's shard is trained in micro-batches whose padded size (rows x longest row) stays
within `trainer.micro_batch_tokens`; their gradients add up. Each micro-batch's loss is
divided by the whole batch's divisors (`LossNorm`, `Shard.num_tokens`), so the sum over the
micro-batches is exactly the whole batch's loss (rft_hpc.algorithms.aggregation). A record
that alone exceeds the budget is dropped by rank 0 before the step (`drop_oversized`), so no
micro-batch is ever larger than the budget.
"""

from __future__ import annotations

from collections.abc import Sequence

from rft_hpc.buffer.reader import Batch
from rft_hpc.buffer.records import DPOPair, Record
from rft_hpc.trainer.distributed import Shard


def record_shape(record: Record, pair_rows: int = 2) -> tuple[int, int]:
    """(rows, tokens of the longest row) of `record` once collated: a preference pair is
    `pair_rows` rows (DPO's two; KTO's three, the third about as long as the others)."""
    if isinstance(record, DPOPair):
        return pair_rows, max(len(record.chosen_tokens), len(record.rejected_tokens))
    return 1, len(record.tokens)


def record_cost(record: Record, pair_rows: int = 2) -> int:
    """Padded tokens `record` alone takes in a micro-batch."""
    rows, length = record_shape(record, pair_rows)
    return rows * length


def drop_oversized(batch: Batch, budget: int, pair_rows: int = 2) -> tuple[Batch, int]:
    """`batch` without the records that alone exceed `budget` padded tokens, and how many
    were dropped; `batch` itself when the budget is 0 (off) or nothing is dropped."""
    if budget <= 0:
        return batch, 0
    keep = [i for i, r in enumerate(batch.records) if record_cost(r, pair_rows) <= budget]
    if len(keep) == len(batch.records):
        return batch, 0

    def pick(values: list) -> list:
        return [values[i] for i in keep] if len(values) == len(batch.records) else values
    kept = Batch(records=pick(batch.records), refs=pick(batch.refs), weights=pick(batch.weights),
                 uses=pick(batch.uses), dropped_stale=batch.dropped_stale)
    return kept, len(batch.records) - len(keep)


def pack(records: Sequence[Record], budget: int, pair_rows: int = 2) -> list[list[int]]:
    """Indices of `records` grouped into micro-batches of at most `budget` padded tokens.

    Longest first, greedily: a micro-batch takes the next record while (rows x its longest
    row) stays within the budget. Budget 0: one micro-batch of everything. Every record must
    fit alone (see `drop_oversized`); an empty list gives no micro-batch.
    """
    if not records:
        return []
    if budget <= 0:
        return [list(range(len(records)))]
    shapes = [record_shape(r, pair_rows) for r in records]
    order = sorted(range(len(records)), key=lambda i: shapes[i][1], reverse=True)
    groups: list[list[int]] = []
    rows = longest = 0
    for i in order:
        r_rows, r_len = shapes[i]
        if r_rows * r_len > budget:
            raise ValueError(f"record {i} needs {r_rows * r_len} tokens, over the budget "
                             f"{budget}: drop it first")
        if groups and (rows + r_rows) * max(longest, r_len) <= budget:
            groups[-1].append(i)
            rows += r_rows
            longest = max(longest, r_len)
        else:
            groups.append([i])
            rows, longest = r_rows, r_len
    return groups


def sub_shard(shard: Shard, indices: list[int]) -> Shard:
    """The part of `shard` made of its records at `indices`, with their rows of the
    whole-batch tensors and the same whole-batch divisors."""
    n = len(shard.records)
    records = [shard.records[i] for i in indices]

    def rows_of(t):
        per = t.shape[0] // n  # rows per record: 2 for DPO pairs
        return t[[i * per + j for i in indices for j in range(per)]]
    return Shard(records=records,
                 advantages=None if shard.advantages is None else rows_of(shard.advantages),
                 num_tokens=shard.num_tokens, num_records=shard.num_records,
                 dropped_stale=shard.dropped_stale,
                 rows={name: rows_of(t) for name, t in shard.rows.items()},
                 norm=shard.norm, expert_norm=shard.expert_norm, metrics=shard.metrics)
