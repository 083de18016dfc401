"""Delay packets by a fixed time through the kernel's netfilter queue, for kernels without the
netem qdisc (NetnsCluster.netem's fallback).

    python pagedkv/testing/nfq_delay.py --queue N --delay-ms 50   (prints "ready" once bound)

Run inside a network namespace whose iptables send packets to queue N (`-j NFQUEUE
--queue-num N`): the kernel holds each queued packet until this process gives its verdict,
which it does `delay_ms` after the packet arrived (accept, in arrival order). Plain netlink
(NETLINK_NETFILTER, nfnetlink_queue), no library: only packet ids cross (copy mode META).
"""

from __future__ import annotations

import argparse
import collections
import socket
import struct
import threading
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NF_ACCEPT = 1
NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_NFGEN = struct.Struct("!BBH")  # family, version, res_id (big-endian)


def _attr(kind: int, payload: bytes) -> bytes:
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


def _message(kind: int, queue: int, attrs: bytes) -> bytes:
    body = _NFGEN.pack(socket.AF_UNSPEC, 0, queue) + attrs
    return _NLMSG.pack(_NLMSG.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind,
                       NLM_F_REQUEST, 0, 0) + body


def bind(sock: socket.socket, queue: int) -> None:
    """Bind queue `queue` for IPv4, copying packet metadata only."""
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(
        NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET))))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(
        NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))))


def packet_ids(data: bytes) -> list[int]:
    """The packet ids of the queued-packet messages in one netlink read."""
    ids, offset = [], 0
    while offset + _NLMSG.size <= len(data):
        length, kind, _, _, _ = _NLMSG.unpack_from(data, offset)
        if length < _NLMSG.size:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos, end = offset + _NLMSG.size + _NFGEN.size, offset + length
            while pos + 4 <= end:
                alen, akind = struct.unpack_from("=HH", data, pos)
                if akind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                    break
                pos += max(4, (alen + 3) & ~3)
        offset += (length + 3) & ~3
    return ids


def verdict(sock: socket.socket, queue: int, packet_id: int) -> None:
    sock.send(_message(NFQNL_MSG_VERDICT, queue, _attr(
        NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))))


def run(queue: int, delay_s: float) -> None:
    """Accept every packet of `queue` `delay_s` after it arrived, until killed."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((0, 0))
    bind(sock, queue)
    print("ready", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    ready = threading.Condition()

    def release() -> None:
        while True:
            with ready:
                while not held:
                    ready.wait()
                due, packet_id = held[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with ready:
                held.popleft()
            verdict(sock, queue, packet_id)

    threading.Thread(target=release, daemon=True).start()
    while True:
        ids = packet_ids(sock.recv(1 << 16))
        now = time.monotonic()
        with ready:
            held.extend((now + delay_s, i) for i in ids)
            ready.notify()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    run(args.queue, args.delay_ms / 1e3)


if __name__ == "__main__":
    main()
