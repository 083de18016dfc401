"""The data-parallel front end in the simulator: `pagedkv simulate --data-parallel-size N`
places each request on one of N instances with the very `CorePlacer` that `pagedkv serve
--data-parallel-size N` uses (pagedkv/engine/placement/cores.py), fed what the real front end
sees: each core's queues and KV usage (after its latest step), and its own books of the
requests it placed (first tokens and finishes, read from the simulated records).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.placement.cores import CoreLoad, CorePlacer
from pagedkv.sim.instance import SimInstance
from pagedkv.sim.records import RequestRecord


class SimDPFrontend:
    """`place` a request on one of `instances`, as the data-parallel front end would."""

    def __init__(self, instances: Sequence[SimInstance], capacity_blocks: int) -> None:
        self.instances = list(instances)
        self.placer = CorePlacer(len(self.instances), capacity_blocks=capacity_blocks)
        self._open: dict[str, RequestRecord] = {}  # placed and not finished, by request id

    def _settle(self) -> None:
        """Book the first tokens and finishes since the last placement, and each core's load."""
        for rid, record in list(self._open.items()):
            if record.finish is not None or record.status == "rejected":
                self.placer.finished(rid)
                del self._open[rid]
            elif record.first_token is not None:
                self.placer.prefilled(rid)
        for core, inst in enumerate(self.instances):
            sched = inst.scheduler
            self.placer.update_load(core, CoreLoad(
                running=len(sched.running), waiting=len(sched.waiting) + len(sched.loading),
                kv_usage=inst.kv.usage))

    def place(self, record: RequestRecord, block_hashes: Sequence[bytes]) -> int:
        """The instance for `record`'s request (booked there)."""
        self._settle()
        rid = str(record.index)
        core = self.placer.place(rid, record.prompt_tokens, block_hashes)
        self._open[rid] = record
        return core
