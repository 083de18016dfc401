"""BlockTableRows (the attention backends' persistent block-table tensor): every step's tensor
equals the padded tables built from scratch, and only rows whose table changed are written."""

from __future__ import annotations

import random

import torch

from pagedkv.model.backends.table_rows import BlockTableRows


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables],
                        dtype=torch.long).view(len(tables), width)


def test_only_changed_rows_are_written():
    rows = BlockTableRows()
    tables = [[3, 4], [7], [9, 10, 11]]
    first = rows.build(tables)
    assert torch.equal(first, _padded(tables)) and rows.rows_written == 3
    assert torch.equal(rows.build(tables), _padded(tables)) and rows.rows_written == 3
    rows.build([[1, 2, 3], [4, 5, 6], [7, 8, 9]])  # another table in the same step (KV groups)
    assert torch.equal(first, _padded(tables))  # the first is unchanged
    assert torch.equal(rows.build(tables), _padded(tables)) and rows.rows_written == 9
    tables[1].append(12)  # the caller's lists change in place: the rows kept their own copy
    assert torch.equal(rows.build(tables), _padded(tables)) and rows.rows_written == 10
    tables[0][1] = 5  # a block replaced (copy-on-write), same length
    assert torch.equal(rows.build(tables), _padded(tables)) and rows.rows_written == 11
    shorter = [[7, 12], [3, 5]]  # rows 0 and 1 now hold other tables; a shorter batch
    out = rows.build(shorter)
    assert out.shape == (2, 2) and torch.equal(out, _padded(shorter)) and rows.rows_written == 13
    assert rows.build([]).shape == (0, 0)


def test_random_steps_match_tables_built_from_scratch():
    rng = random.Random(0)
    rows = BlockTableRows(torch.int32)
    live = {i: [rng.randrange(1, 500) for _ in range(rng.randint(0, 6))] for i in range(40)}
    written = 0
    for _ in range(300):
        for table in live.values():
            r = rng.random()
            if r < 0.2:
                table.append(rng.randrange(1, 500))  # a block appended
            elif r < 0.25 and table:
                table[rng.randrange(len(table))] = rng.randrange(1, 500)  # a block replaced
            elif r < 0.27:
                del table[rng.randrange(len(table) + 1):]  # preempted and regrown
        batch = rng.sample(sorted(live), rng.randint(0, len(live)))
        if rng.random() < 0.7:
            batch.sort()  # usually the same order as the step before
        tables = [live[i] for i in batch]
        before = [list(t) for t in rows._rows[:len(tables)]]
        before += [[]] * (len(tables) - len(before))  # rows not used yet hold no blocks
        out = rows.build(tables)
        assert out.dtype == torch.int32 and out.is_contiguous()
        assert torch.equal(out, _padded(tables).to(torch.int32))
        changed = sum(1 for was, t in zip(before, tables, strict=True) if was != t)
        assert rows.rows_written - written == changed
        written = rows.rows_written
