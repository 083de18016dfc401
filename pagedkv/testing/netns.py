"""NetnsCluster: hosts as Linux network namespaces on a private bridge, for multi-host tests.

Each host is a namespace with loopback and one interface, `eth0`, a veth pair whose other end
is a port of a bridge that lives in a namespace of its own (the switch): nothing of a cluster
is in the machine's own namespace, so nothing can listen on or send to its real interfaces,
and two clusters (parallel runs) never share a name or an address. Host i has 10.213.0.(i+1).

Processes run inside a host with `ip netns exec` (`popen`); a function runs inside a host in
a thread that joined its namespace (`call`: its sockets are the host's). Faults are the
kernel's own: `link_down` sets the host's switch port down (a cable pulled), `loss` drops a
share of its packets (nftables), `netem` adds delay and loss (tc netem; without it, the netfilter
queue held for the delay by nfq_delay.py, and nftables' random drop), `partition` drops everything between two hosts (nftables, or pinned neighbour entries).

Names carry the creating process's pid: `janitor()` removes the namespaces of runs whose
process is gone (killed before its cleanup ran). Needs root, iproute2 and, for `loss`, nft
(Debian's nftables); `NetnsUnavailable` says what is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

PREFIX = "pkvt-"
SUBNET = "10.213.0"
IFNAME = "eth0"  # every host's interface; GLOO_SOCKET_IFNAME names it for torch.distributed
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/var/run/netns"
_NOWHERE_MAC = "02:00:5e:ff:ff:fe"  # locally administered; no host of a cluster has it
T = TypeVar("T")


class NetnsUnavailable(RuntimeError):
    """Namespaces (or one fault tool) cannot be used here; the message says why."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    name = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        probe = _run("ip", "netns", "add", name, check=False)
        if probe.returncode != 0:
            return f"`ip netns add` failed: {probe.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


@dataclass
class Host:
    """One host of a cluster: namespace `ns`, address `addr` on `eth0`, switch port `port`."""

    index: int
    ns: str
    addr: str
    port: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class NetnsCluster:
    """`n_hosts` hosts on one bridge; use as a context manager (or call `close`)."""

    def __init__(self, n_hosts: int) -> None:
        if not 1 <= n_hosts <= 200:
            raise ValueError(f"n_hosts={n_hosts} must be 1..200")
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        janitor()
        self.run_id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.run_id}-sw"
        self.hosts = [Host(i, f"{self.run_id}-h{i}", f"{SUBNET}.{i + 1}", f"p{i}")
                      for i in range(n_hosts)]
        self._closed = False
        self._delayers: dict[int, subprocess.Popen] = {}
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    # ---- building and removing -----------------------------------------------------------

    def _build(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            _run("ip", "netns", "add", h.ns)
            _run("ip", "-n", h.ns, "link", "set", "lo", "up")
            _run("ip", "-n", h.ns, "link", "add", IFNAME, "type", "veth", "peer", "name",
                 h.port, "netns", sw)
            _run("ip", "-n", sw, "link", "set", h.port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", h.port, "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", IFNAME)
            _run("ip", "-n", h.ns, "link", "set", IFNAME, "up")

    def close(self) -> None:
        """Stop every process started in a host, then remove the namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            for p in h.procs:
                _kill_group(p)
        for ns in [h.ns for h in self.hosts] + [self.switch]:
            remove_namespace(ns)

    # ---- running things inside a host ----------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a host's processes: no proxies (none is reachable from a host),
        gloo on the host's interface."""
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        env["GLOO_SOCKET_IFNAME"] = IFNAME
        env.update(extra or {})
        return env

    def popen(self, host: Host, cmd: Sequence[str], *, env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start `cmd` inside `host` (its own process group; killed by `close`)."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *cmd], env=self.env(env),
                                start_new_session=True, **kwargs)
        host.procs.append(proc)
        return proc

    def run(self, host: Host, cmd: Sequence[str], timeout: float = 30) -> str:
        """Run `cmd` inside `host` to its end; its stdout (RuntimeError on failure)."""
        proc = subprocess.run(["ip", "netns", "exec", host.ns, *cmd], env=self.env(),
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{host.ns}: {' '.join(cmd)}: {proc.stderr.strip()}")
        return proc.stdout

    def call(self, host: Host, fn: Callable[..., T], *args: Any, timeout: float = 120) -> T:
        """`fn(*args)` in a thread inside `host`'s namespace (its sockets are the host's)."""
        return in_namespace(host.ns, fn, *args, timeout=timeout)

    # ---- faults --------------------------------------------------------------------------

    def link_down(self, host: Host) -> None:
        """Pull `host`'s cable: its switch port goes down (no packet in or out)."""
        _run("ip", "-n", self.switch, "link", "set", host.port, "down")

    def link_up(self, host: Host) -> None:
        _run("ip", "-n", self.switch, "link", "set", host.port, "up")

    def netem(self, host: Host, delay_ms: float, loss_pct: float = 0.0) -> None:
        """Delay every packet `host` sends by `delay_ms` and drop `loss_pct`% of them: tc
        netem, or where the kernel has no netem qdisc, its netfilter queue held by
        nfq_delay.py (iptables NFQUEUE) and nftables' random drop."""
        proc = _run("ip", "netns", "exec", host.ns, "tc", "qdisc", "replace", "dev", IFNAME,
                    "root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%",
                    check=False)
        if proc.returncode == 0:
            return
        iptables = shutil.which("iptables-legacy") or shutil.which("iptables")
        if iptables is None or shutil.which("nft") is None:
            raise NetnsUnavailable(f"tc netem: {proc.stderr.strip()} (no netem qdisc: "
                                   "CONFIG_NET_SCH_NETEM), and no iptables and nft to delay "
                                   "through the netfilter queue instead")
        self.clear_netem(host)
        delayer = self.popen(host, [sys.executable, str(Path(__file__).with_name(
            "nfq_delay.py")), "--queue", str(host.index), "--delay-ms", str(delay_ms)],
            stdout=subprocess.PIPE, text=True)
        if delayer.stdout.readline().strip() != "ready":
            raise RuntimeError(f"nfq_delay in {host.ns} did not start")
        self._delayers[host.index] = delayer
        _run("ip", "netns", "exec", host.ns, iptables, *self._queue_rule(host, "-A"))
        if loss_pct:
            share = round(loss_pct * 100)
            self._nft(host, "add table inet pkvnetem",
                      "add chain inet pkvnetem out { type filter hook output priority 0; }",
                      f'add rule inet pkvnetem out oifname "{IFNAME}" numgen random mod '
                      f"10000 < {share} drop")

    def clear_netem(self, host: Host) -> None:
        _run("ip", "netns", "exec", host.ns, "tc", "qdisc", "del", "dev", IFNAME, "root",
             check=False)
        delayer = self._delayers.pop(host.index, None)
        if delayer is None:
            return
        iptables = shutil.which("iptables-legacy") or shutil.which("iptables") or "iptables"
        _run("ip", "netns", "exec", host.ns, iptables, *self._queue_rule(host, "-D"),
             check=False)
        _kill_group(delayer)
        _run("ip", "netns", "exec", host.ns, "nft", "delete table inet pkvnetem", check=False)

    @staticmethod
    def _queue_rule(host: Host, action: str) -> list[str]:
        return ["-w", "5", action, "OUTPUT", "-o", IFNAME, "-j", "NFQUEUE", "--queue-num",
                str(host.index)]

    def loss(self, host: Host, loss_pct: float) -> None:
        """Drop `loss_pct`% of the packets `host` sends and receives on eth0 (nftables)."""
        share = round(loss_pct * 100)  # of 10000
        self._nft(host, "add table inet pkvloss",
                  "add chain inet pkvloss in { type filter hook input priority 0; }",
                  "add chain inet pkvloss out { type filter hook output priority 0; }",
                  f'add rule inet pkvloss in iifname "{IFNAME}" numgen random mod 10000 '
                  f'< {share} drop',
                  f'add rule inet pkvloss out oifname "{IFNAME}" numgen random mod 10000 '
                  f'< {share} drop')

    def clear_loss(self, host: Host) -> None:
        self._nft(host, "delete table inet pkvloss")

    def partition(self, a: Host, b: Host) -> None:
        """Drop every packet between `a` and `b`, silently, both ways: nftables on both, or
        without nft, each host's neighbour entry for the other pinned to a MAC address no
        host has (the bridge floods those frames; every host drops them)."""
        if shutil.which("nft") is None:
            for me, other in ((a, b), (b, a)):
                _run("ip", "-n", me.ns, "neigh", "replace", other.addr, "lladdr", _NOWHERE_MAC,
                     "dev", IFNAME, "nud", "permanent")
            return
        for me, other in ((a, b), (b, a)):
            table = f"pkvpart{other.index}"
            self._nft(me, f"add table inet {table}",
                      f"add chain inet {table} in {{ type filter hook input priority 0; }}",
                      f"add chain inet {table} out {{ type filter hook output priority 0; }}",
                      f"add rule inet {table} in ip saddr {other.addr} drop",
                      f"add rule inet {table} out ip daddr {other.addr} drop")

    def heal(self, a: Host, b: Host) -> None:
        """Undo `partition(a, b)`."""
        if shutil.which("nft") is None:
            for me, other in ((a, b), (b, a)):
                _run("ip", "-n", me.ns, "neigh", "del", other.addr, "dev", IFNAME, check=False)
            return
        self._nft(a, f"delete table inet pkvpart{b.index}")
        self._nft(b, f"delete table inet pkvpart{a.index}")

    def _nft(self, host: Host, *commands: str) -> None:
        if shutil.which("nft") is None:
            raise NetnsUnavailable("no `nft` (nftables) on PATH")
        _run("ip", "netns", "exec", host.ns, "nft", "; ".join(commands))

    # ---- what listens where --------------------------------------------------------------

    def listeners(self, host: Host) -> list[str]:
        """Local addresses (`addr:port`) of the TCP sockets listening inside `host`."""
        return listening_addresses(self.run(host, ["ss", "-Hltn"]))


def listening_addresses(ss_output: str) -> list[str]:
    """The local address column of `ss -Hltn` output."""
    return [line.split()[3] for line in ss_output.splitlines() if line.strip()]


def in_namespace(ns: str, fn: Callable[..., T], *args: Any, timeout: float = 120) -> T:
    """`fn(*args)` run by a new thread that first joined network namespace `ns` (setns(2)
    changes the calling thread only); its result, or what it raised."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(os.path.join(_NETNS_DIR, ns)) as f:
                if libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns}")
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} in {ns} ran past {timeout}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def remove_namespace(ns: str) -> None:
    """Kill what still runs in `ns`, then delete it (its veth ends go with it)."""
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "netns", "del", ns, check=False)


def janitor() -> list[str]:
    """Remove the namespaces of clusters whose creating process is gone; their names."""
    names = [line.split()[0] for line in _run("ip", "netns", "list", check=False)
             .stdout.splitlines() if line.startswith(PREFIX)]
    removed = []
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            remove_namespace(name)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
