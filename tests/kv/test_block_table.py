"""Incremental block tables (kv/block_table.py): BlockList counts its rewrites, BlockIdTable
appends only the new blocks' ids and rebuilds after a rewrite, through the manager's
copy-on-write, sliding window, trim, swap and re-admission."""

import random

from pagedkv.kv.block import KVCacheBlock
from pagedkv.kv.block_table import BlockIdTable, BlockList
from pagedkv.kv.manager import KVCacheManager
from tests.kv.conftest import decode, make_request, prefill

BS = 4


def blocks(*ids: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in ids]


def test_appends_keep_the_count_every_other_change_counts_one_rewrite():
    table = BlockList(blocks(1, 2))
    table.append(KVCacheBlock(3))
    table.extend(blocks(4))
    table += blocks(5)
    assert table.rewrites == 0 and [b.block_id for b in table] == [1, 2, 3, 4, 5]
    changes = [lambda t: t.__setitem__(0, KVCacheBlock(9)), lambda t: t.__delitem__(slice(3, None)),
               lambda t: t.pop(), lambda t: t.insert(0, KVCacheBlock(8)),
               lambda t: t.remove(t[0]), lambda t: t.reverse(),
               lambda t: t.sort(key=lambda b: b.block_id), lambda t: t.__imul__(2), lambda t: t.clear()]
    for i, change in enumerate(changes, start=1):
        change(table)
        assert table.rewrites == i


def test_sync_appends_only_the_new_blocks_ids():
    table = BlockList(blocks(1, 2))
    ids = BlockIdTable()
    out = ids.sync(table)
    assert out == [1, 2] and out is ids.ids
    table[0].block_id = 77  # not a list change: an incremental sync does not read it again
    table.append(KVCacheBlock(3))
    assert ids.sync(table) == [1, 2, 3] and ids.sync(table) is out
    table[1] = KVCacheBlock(5)  # a rewrite: rebuilt from the list
    assert ids.sync(table) == [77, 5, 3] and ids.ids is out


def test_sync_rebuilds_for_another_list_or_a_plain_list():
    ids = BlockIdTable()
    first = BlockList(blocks(1, 2, 3))
    ids.sync(first)
    assert ids.sync(BlockList(blocks(4))) == [4]  # another list (a swap, a re-admission)
    plain = blocks(6, 7)
    assert ids.sync(plain) == [6, 7]
    plain[0] = KVCacheBlock(8)  # a plain list cannot report it: always rebuilt
    assert ids.sync(plain) == [8, 7]
    assert ids.sync([]) == []


def test_sync_matches_the_table_under_random_edits():
    rng = random.Random(0)
    table = BlockList()
    ids = BlockIdTable()
    next_id = 1
    for _ in range(2000):
        op = rng.randrange(6)
        if op <= 2 or not table:
            table.extend(blocks(*range(next_id, next_id + rng.randint(1, 3))))
            next_id += 3
        elif op == 3:
            table[rng.randrange(len(table))] = KVCacheBlock(next_id)
            next_id += 1
        elif op == 4:
            del table[rng.randrange(len(table)):]
        else:
            table = BlockList(table[: rng.randrange(len(table) + 1)])
        assert ids.sync(table) == [b.block_id for b in table]


def check(m: KVCacheManager, tables: dict[str, BlockIdTable], *rids: str) -> None:
    for rid in rids:
        assert m.sync_block_ids(rid, tables.setdefault(rid, BlockIdTable())) == m.get_block_ids(rid)
    m.check_invariants()


def test_manager_sync_follows_copy_on_write_window_trim_swap_and_readmission():
    m = KVCacheManager(num_blocks=33, block_size=BS, watermark=0.0, num_host_blocks=16)
    tables: dict[str, BlockIdTable] = {}
    parent = make_request("p", range(10))
    prefill(m, parent)
    check(m, tables, "p")
    child = make_request("c", range(10))
    child.num_computed_tokens = 10
    m.fork(parent, child)
    check(m, tables, "p", "c")
    decode(m, parent, 50)  # copy-on-write of the shared partial block
    assert m.take_block_copies()
    check(m, tables, "p", "c")
    for t in range(51, 60):  # appends
        decode(m, parent, t)
        check(m, tables, "p")
    m.trim_blocks(parent, 8)
    check(m, tables, "p")
    m.swap_out(child)
    check(m, tables, "c")
    m.swap_in(child)
    check(m, tables, "c")
    m.free(parent)
    check(m, tables, "p")
    again = make_request("p", range(200, 214))  # the same id, re-admitted: other blocks
    prefill(m, again)
    check(m, tables, "p")
    w = KVCacheManager(num_blocks=17, block_size=BS, watermark=0.0, sliding_window=8)
    r = make_request("r", range(12))
    prefill(w, r)
    check(w, tables, "r")
    for t in range(12, 30):  # blocks leave the window: nulled in place
        decode(w, r, t)
        check(w, tables, "r")
    assert w.get_block_ids("r")[:3] == [0, 0, 0]
