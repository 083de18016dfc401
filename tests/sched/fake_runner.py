"""A model-free runner that checks the scheduler's memory bookkeeping end to end.

The "KV cache" holds token ids: slot `block_id * block_size + offset` stores the token at that
position. Each step applies swaps and copies exactly as the real runner must, writes the
scheduled tokens into their slots, and "attends" by reading every position of the sequence back
through the block table. The next token is a deterministic function of what was read. Any wrong
block table, missed copy-on-write, bad swap mapping or premature free changes what is read, and
so the generated tokens: the outputs must equal `reference_continuation` whatever the schedule.
"""

from __future__ import annotations

import hashlib

from pagedkv.kv.block_pool import host_pool_num_blocks
from pagedkv.sched.output import ModelRunnerOutput, SchedulerOutput

EMPTY = -1


def next_token(tokens: list[int], vocab_size: int, salt: int = 0, window: int | None = None) -> int:
    """The fake model: a hash of the visible tokens (the last `window` ones) and their count."""
    visible = tokens if window is None else tokens[-window:]
    digest = hashlib.blake2b(repr((salt, len(tokens), visible)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


def reference_continuation(prompt: list[int], num_tokens: int, vocab_size: int,
                           sample_index: int = 0, window: int | None = None) -> list[int]:
    tokens = list(prompt)
    out = []
    for i in range(num_tokens):
        # Sample i of an n>1 request differs only in its first token (it forks after the prompt).
        token = next_token(tokens, vocab_size, salt=sample_index if i == 0 else 0, window=window)
        tokens.append(token)
        out.append(token)
    return out


class FakeRunner:
    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int,
                 vocab_size: int = 1000, window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window
        self.vocab_size = vocab_size
        self.device = [EMPTY] * (num_blocks * block_size)
        # Sized as the real KVCache's host tensor is: a host id past it raises IndexError.
        self.host = [EMPTY] * (host_pool_num_blocks(num_host_blocks) * block_size)
        self.num_steps = 0

    def _copy_block(self, src: list[int], src_block: int, dst: list[int], dst_block: int) -> None:
        bs = self.block_size
        for block, pool in ((src_block, src), (dst_block, dst)):
            if not 0 <= block < len(pool) // bs:
                raise IndexError(f"block id {block} out of range [0, {len(pool) // bs})")
        dst[dst_block * bs:(dst_block + 1) * bs] = src[src_block * bs:(src_block + 1) * bs]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for dev, host in out.blocks_to_swap_out:
            self._copy_block(self.device, dev, self.host, host)
        for host, dev in out.blocks_to_swap_in:
            self._copy_block(self.host, host, self.device, dev)
        for src, dst in out.blocks_to_copy:
            self._copy_block(self.device, src, self.device, dst)
        bs = self.block_size
        for req in out.scheduled:  # all writes first, as the real runner does per layer
            for i, token in enumerate(req.token_ids):
                pos = req.start_pos + i
                self.device[req.block_table[pos // bs] * bs + pos % bs] = token
        result = ModelRunnerOutput()
        for req in out.scheduled:
            if req.num_samples == 0:
                continue
            end = req.start_pos + req.num_new_tokens
            first = 0 if self.window is None else max(0, end - self.window)
            # Positions outside the window are never read (their blocks may be the null block).
            seen = [EMPTY] * first + [self.device[req.block_table[p // bs] * bs + p % bs]
                                      for p in range(first, end)]
            tokens = []
            for i in range(req.num_samples):
                salt = i if req.num_samples > 1 else 0  # sample i of an n>1 request
                tokens.append(next_token(seen, self.vocab_size, salt=salt, window=self.window))
            result.sampled_token_ids[req.request_id] = tokens
        return result


def run_to_end(sched, runner: FakeRunner, late: dict | None = None, max_steps: int = 100,
               ) -> tuple[list[dict[str, int]], dict]:
    """Steps `sched` with `runner` until nothing is left (at most `max_steps`), checking the
    scheduler's invariants after every step: each step's {request id: tokens computed} and the
    finished requests by id. `late`: {step index: a request added before that step}."""
    steps, finished = [], {}
    for index in range(max_steps):
        if late and index in late:
            sched.add_request(late[index])
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        steps.append({s.request_id: len(s.token_ids) for s in out.scheduled})
        for request in sched.update(out, runner.execute(out)):
            if request.is_finished:
                finished[request.request_id] = request
        sched.check_invariants()
    return steps, finished
