#!/usr/bin/env python3
"""Latency of several HTTP paths to one upstream, measured in turn.

One keep-alive connection per path, one request at a time, the paths taken
in turn request by request (direct, proxy A, proxy B, direct, ...): a slow
spell of the machine falls on every path alike, where runs of a few seconds
each (one path after another) see different spells. What a proxy adds is
its latency minus the direct path's, per percentile. The client's own time
is in every path's figure and cancels out of that difference.

    paired-latency.py SECONDS PATH BODY NAME=HOST:PORT...

Prints one line per path: NAME p50_us p99_us requests errors. Loopback
only: it refuses any other address.
"""
import socket
import sys
import time


def connect(host, port):
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"{host}: only loopback addresses are measured")
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def exchange(sock, request, buf):
    """Sends one request, reads one response; returns (status, rest of buf,
    whether the server closes the connection after it)."""
    sock.sendall(request)
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the response head")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length, closes = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding":
            raise ValueError("chunked responses are not measured")
        elif name == b"connection" and value.strip().lower() == b"close":
            closes = True
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the response body")
        rest += chunk
    return status, rest[length:], closes


def percentile(sorted_us, q):
    if not sorted_us:
        return float("nan")
    k = min(len(sorted_us) - 1, max(0, int(round(q * (len(sorted_us) - 1)))))
    return sorted_us[k]


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    seconds = float(sys.argv[1])
    path, body = sys.argv[2], sys.argv[3].encode()
    targets = []
    for arg in sys.argv[4:]:
        name, _, addr = arg.partition("=")
        host, _, port = addr.rpartition(":")
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        targets.append({"name": name, "addr": (host, int(port)), "req": request,
                        "sock": connect(host, int(port)), "buf": b"", "us": [], "errors": 0})
    # Warm-up: the connections open and every path has answered.
    def reopen(t):
        t["sock"].close()
        t["sock"], t["buf"] = connect(*t["addr"]), b""

    for t in targets:
        for _ in range(50):
            _, t["buf"], closes = exchange(t["sock"], t["req"], t["buf"])
            if closes:
                reopen(t)
    end = time.monotonic() + seconds
    clock = time.perf_counter_ns
    while time.monotonic() < end:
        for t in targets:
            start = clock()
            try:
                status, t["buf"], closes = exchange(t["sock"], t["req"], t["buf"])
            except (OSError, ValueError):
                t["errors"] += 1
                reopen(t)
                continue
            took = (clock() - start) / 1000
            # A server that ends the connection (nginx after 1000 requests
            # on one) is reconnected outside the measured time.
            if closes:
                reopen(t)
            if status == 200:
                t["us"].append(took)
            else:
                t["errors"] += 1
    for t in targets:
        us = sorted(t["us"])
        print(f"{t['name']} {percentile(us, 0.5):.1f} {percentile(us, 0.99):.1f} {len(us)} {t['errors']}")


if __name__ == "__main__":
    main()
