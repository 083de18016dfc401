"""CpuThreadGovernor: fewer threads as other processes take cores, all of them when quiet."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from pagedkv.model import cpu_threads
from pagedkv.model.cpu_threads import CpuThreadGovernor


@pytest.fixture(autouse=True)
def _no_omp_limit(monkeypatch):
    """The governor's ceiling is every allowed CPU here (tests/conftest.py sets OMP_NUM_THREADS
    under xdist); test_omp_num_threads_caps_the_threads sets it itself."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.fixture
def fake_machine(monkeypatch):
    """A 4-CPU machine whose busy ticks, our own ticks and clock the test drives (100 ticks/s)."""
    state = {"now": 1000.0, "busy": 0, "own": 0}
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(cpu_threads, "busy_ticks", lambda cpus: state["busy"])
    monkeypatch.setattr(cpu_threads, "_own_ticks", lambda: state["own"])
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: state["now"])
    before = torch.get_num_threads()
    yield state
    torch.set_num_threads(before)


def advance(state, seconds, own_cores, other_cores):
    state["now"] += seconds
    state["own"] += int(own_cores * 100 * seconds)
    state["busy"] += int((own_cores + other_cores) * 100 * seconds)


def test_threads_follow_the_cores_others_leave(fake_machine, monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    gov = CpuThreadGovernor()
    assert gov.threads == 4 and torch.get_num_threads() == 4
    gov.adjust()  # first reading: nothing to compare with yet
    advance(fake_machine, 1.0, own_cores=4, other_cores=0)
    assert gov.adjust() == 4
    advance(fake_machine, 1.0, own_cores=2, other_cores=2)  # another process took two cores
    assert gov.adjust() == 2 and torch.get_num_threads() == 2
    assert gov.others_cores == pytest.approx(2.0)
    advance(fake_machine, 0.5, own_cores=2, other_cores=2)
    assert gov.adjust() == 2  # within the interval: no new reading
    advance(fake_machine, 1.0, own_cores=1, other_cores=3.9)  # never fewer than one
    assert gov.adjust() == 1
    advance(fake_machine, 1.0, own_cores=1, other_cores=0.2)  # quiet again: a little noise is free
    assert gov.adjust() == 4


def test_omp_num_threads_caps_the_threads(fake_machine, monkeypatch):
    """OMP_NUM_THREADS=2 on 4 CPUs: 2 threads when quiet; an explicit max_threads wins."""
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    gov = CpuThreadGovernor()
    assert gov.threads == 2 and torch.get_num_threads() == 2
    gov.adjust()
    advance(fake_machine, 1.0, own_cores=2, other_cores=0)
    assert gov.adjust() == 2
    assert CpuThreadGovernor(max_threads=3).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "none")
    assert CpuThreadGovernor().threads == 4


def test_an_idle_gap_does_not_count_what_others_did_meanwhile(fake_machine, monkeypatch):
    """A benchmark's other engine ran while this one was idle: the next step uses every core
    and measures the machine afresh over a short window."""
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    gov = CpuThreadGovernor()
    gov.adjust()
    advance(fake_machine, 1.0, own_cores=1, other_cores=3)
    assert gov.adjust() == 1
    advance(fake_machine, 10.0, own_cores=0, other_cores=4)  # idle; another process busy
    assert gov.adjust() == 4  # the stale window is dropped
    advance(fake_machine, cpu_threads.FIRST_INTERVAL_S / 2, own_cores=2, other_cores=2)
    assert gov.adjust() == 4  # within the short first window: no reading yet
    advance(fake_machine, cpu_threads.FIRST_INTERVAL_S / 2, own_cores=2, other_cores=2)
    assert gov.adjust() == 2 and gov.others_cores == pytest.approx(2.0, abs=0.1)


def test_a_long_step_is_not_an_idle_gap(fake_machine, monkeypatch):
    """A prefill step longer than STALE_S on a busy machine (issue 26: a fresh process's first
    `generate` ran on every core and half as fast): the step reports its end, so the next
    step keeps the reading its window earned instead of going back to every core."""
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    gov = CpuThreadGovernor()
    gov.adjust()
    advance(fake_machine, 1.0, own_cores=1, other_cores=3)
    assert gov.adjust() == 1
    advance(fake_machine, 10.0, own_cores=1, other_cores=3)  # one long step, still busy
    gov.step_done()
    assert gov.adjust() == 1 and gov.others_cores == pytest.approx(3.0)
    gov.step_done()
    advance(fake_machine, 10.0, own_cores=0, other_cores=4)  # now really idle
    assert gov.adjust() == 4  # the stale window is dropped, as without step_done


def test_max_threads_caps_the_count(fake_machine, monkeypatch):
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    gov = CpuThreadGovernor(max_threads=2)
    gov.adjust()
    advance(fake_machine, 1.0, own_cores=2, other_cores=0)
    assert gov.adjust() == 2


def test_real_proc_readings_count_this_process():
    cpus = cpu_threads.allowed_cpus()
    busy, own = cpu_threads.busy_ticks(cpus), cpu_threads._own_ticks()
    if busy is None or own is None:
        pytest.skip("no /proc here")
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    assert cpu_threads._own_ticks() > own
    assert cpu_threads.busy_ticks(cpus) >= busy + (cpu_threads._own_ticks() - own) // 2


def test_a_partner_process_counts_as_own(monkeypatch):
    """An engine core counts its frontend's CPU (count_as_own) as its own, not as another
    process's: a busy partner's ticks show in the own reading."""
    if cpu_threads._own_ticks() is None:
        pytest.skip("no /proc here")
    partner = subprocess.Popen([sys.executable, "-c",
                                "import time\nend = time.monotonic() + 5\n"
                                "while time.monotonic() < end: pass"])
    try:
        monkeypatch.setattr(cpu_threads, "_PARTNER_PIDS", set())
        start_partner = cpu_threads._process_ticks(f"/proc/{partner.pid}/stat") or 0
        alone = cpu_threads._own_ticks()
        cpu_threads.count_as_own(partner.pid)
        with_partner = cpu_threads._own_ticks()
        assert with_partner >= alone + start_partner
        time.sleep(0.5)
        grown = cpu_threads._own_ticks() - with_partner
        partner_ticks = cpu_threads._process_ticks(f"/proc/{partner.pid}/stat") - start_partner
        assert partner_ticks > 0 and grown >= partner_ticks // 2
    finally:
        partner.kill()
        partner.wait()
    assert cpu_threads._own_ticks() is not None  # a partner that is gone counts nothing


class _Machine:
    """The governor's /proc reader seam: `others` cores' worth of other processes' CPU time and
    `own` cores' worth of ours, over `cpus` CPUs, on a clock the test advances (100 ticks/s)."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 1000.0, 0, 0

    def read(self, cpus):
        return self.busy, self.own

    def run(self, seconds, own_cores, other_cores):
        self.now += seconds
        self.own += round(own_cores * 100 * seconds)
        self.busy += round((own_cores + other_cores) * 100 * seconds)


@pytest.mark.parametrize("own_cores,other_cores", [(0, 4), (0.5, 3.5), (0, 6), (1, 5)])
def test_never_fewer_than_one_thread_when_others_hold_every_core(own_cores, other_cores):
    before = torch.get_num_threads()
    machine = _Machine()
    try:
        gov = CpuThreadGovernor(read_ticks=machine.read, clock=lambda: machine.now,
                                cpus=[0, 1, 2, 3], ticks_per_s=100)
        assert gov.adjust() == 4
        for _ in range(3):
            machine.run(1.0, own_cores, other_cores)
            assert gov.adjust() == 1
            assert gov.threads == 1 and torch.get_num_threads() == 1
            assert gov.others_cores >= 3.5
        machine.run(1.0, own_cores=4, other_cores=0)  # the others stop: every core again
        assert gov.adjust() == 4
    finally:
        torch.set_num_threads(before)


def test_threads_for_is_at_least_one_for_any_reading():
    for cpus in (1, 2, 4, 64):
        for others in (cpus - 0.5, cpus, cpus + 0.01, cpus * 3, float("inf"), float("nan"),
                       -5.0, float("-inf")):
            threads = cpu_threads.threads_for(cpus, others, cpus)
            assert 1 <= threads <= cpus, (cpus, others, threads)
    assert cpu_threads.threads_for(4, 0.0, 4) == 4
    assert cpu_threads.threads_for(4, 3.0, 4) == 1
