"""A real slow network on one machine: network namespaces joined by shaped veth links.

:class:`NetnsCluster` (root and iproute2's ``ip`` and ``tc`` needed) builds ``n`` test hosts,
network namespaces ``<prefix>0 .. <prefix>{n-1}``, each with one veth link to a bridge in a
hub namespace ``<prefix>hub``; host ``i`` has address ``198.18.0.{i+1}/24`` (the 198.18.0.0/15
benchmarking range) and no other route, so nothing leaves the test hosts. Each link is rate
limited in both directions with a token bucket (``tc qdisc ... tbf``): the host's side limits
what it sends, the hub's side what it receives. The root namespace is not touched except for
``/etc/netns/<name>/hosts`` files, which ``ip netns exec`` mounts over ``/etc/hosts`` so that
the machine's host name resolves to the test host's own address (gloo, which carries JAX's
CPU collectives, binds to the address of the host name).

Latency: this kernel has no ``netem`` qdisc, so no real propagation delay is added. The links
have the veth's own latency (tens of microseconds); a latency figure for the alpha-beta model
is measured by :func:`ping_pong`. Setting up twice with the same prefix, or a prefix whose
namespaces exist, is refused; :meth:`NetnsCluster.close` (also on exceptions, via ``with``)
deletes every namespace and file it made, and nothing else: an ``/etc/netns/<name>/`` that
existed before is refused, never overwritten or removed.

Each namespace made is recorded in ``/run/jaxcomm-netns/<name>`` (with whether its
``/etc/netns`` folder was made too), so a process killed with ``kill -9`` leaves a record of
its leftovers: ``python -m train.netns --cleanup`` deletes exactly those.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import RUN

__all__ = ["NetnsCluster", "available", "cleanup", "ping_pong", "address"]

SUBNET = "198.18.0"
NETNS_ETC = Path("/etc/netns")
REGISTRY = Path("/run/jaxcomm-netns")  # one file per namespace made; cleared at boot


def _record(ns: str, etc_made: bool) -> None:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    (REGISTRY / ns).write_text(f"etc={int(etc_made)} pid={os.getpid()}\n")


def _remove(ns: str) -> str | None:
    """Delete namespace ``ns`` and, when this module made it, its ``/etc/netns`` folder;
    drop its record. Returns an error text, or None."""
    record = REGISTRY / ns
    etc_made = record.is_file() and "etc=1" in record.read_text()
    proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
    error = None
    if proc.returncode and "No such file" not in proc.stderr:
        error = f"{ns}: {proc.stderr.strip()}"
    if etc_made:
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if error is None:
        record.unlink(missing_ok=True)
    return error


def _owner_alive(record: str) -> bool:
    """Whether the process that made a recorded namespace still runs (its cluster is live)."""
    for part in record.split():
        if part.startswith("pid=") and part[4:].isdigit():
            pid = int(part[4:])
            if pid == os.getpid():
                return False
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
    return False


def cleanup() -> list[str]:
    """Delete the namespaces (and ``/etc/netns`` folders) a killed :class:`NetnsCluster`
    left behind, found by their records, and nothing else (not those of a cluster whose
    process still runs); returns the names deleted."""
    if not REGISTRY.is_dir():
        return []
    names = sorted(
        p.name for p in REGISTRY.iterdir() if p.is_file() and not _owner_alive(p.read_text())
    )
    failed = [e for e in (_remove(ns) for ns in names) if e]
    if failed:
        raise RuntimeError("could not delete namespaces: " + "; ".join(failed))
    return names


def address(i: int) -> str:
    """The test address of host ``i`` (``198.18.0.{i+1}``)."""
    return f"{SUBNET}.{i + 1}"


def available() -> str | None:
    """None when namespaces can be built here, else why not (for a test's skip reason)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2's `{tool}` on PATH"
    probe = f"jxprobe{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


class NetnsCluster:
    """``n`` namespaced test hosts on a bridge, links shaped to ``rate_mbit`` (see module).

    Args:
      n: hosts, 1..250.
      rate_mbit: link rate in Mbit/s each way, or None for unshaped links.
      prefix: namespace name prefix (short: interface names are ``<prefix>v<i>``).
    """

    def __init__(self, n: int, rate_mbit: float | None = None, *, prefix: str = "jx"):
        if not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f"n must be an int in [1, 250], got {n!r}")
        if not prefix.isalnum() or len(prefix) > 6:
            raise ValueError(f"prefix must be 1-6 letters or digits, got {prefix!r}")
        self.n, self.prefix = n, prefix
        self.hosts = [f"{prefix}{i}" for i in range(n)]
        self.hub = f"{prefix}hub"
        self.rate_mbit: float | None = None
        self._made: list[str] = []
        self._etc_root_made = False
        why = available()
        if why:
            raise RuntimeError(f"cannot build network namespaces: {why}")
        existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        taken = {line.split()[0] for line in existing.splitlines() if line.strip()}
        clash = sorted(taken & {self.hub, *self.hosts})
        if clash:
            raise RuntimeError(f"namespaces {clash} already exist; delete them or use a new prefix")
        theirs = [str(NETNS_ETC / ns) for ns in self.hosts if (NETNS_ETC / ns).exists()]
        if theirs:
            raise RuntimeError(
                f"{', '.join(theirs)} already exist and were not made by this cluster; they are "
                "left as they are: use another prefix"
            )
        try:
            self._build()
            self.shape(rate_mbit)
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        hostname = socket.gethostname()
        self._add(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir(parents=True)
            self._etc_root_made = True
        for i, ns in enumerate(self.hosts):
            self._add(ns)
            # IPv4 on the test range only: no IPv6 link-local addresses either.
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")
            dev, peer = f"{self.prefix}v{i}", f"{self.prefix}b{i}"
            _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer,
                 "netns", self.hub)  # fmt: skip
            _run("ip", "-n", ns, "addr", "add", f"{address(i)}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Packets of one MTU (no 64 KB GSO segments), so a small token bucket can
            # shape every message, not only those larger than the bucket.
            _run("ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", "1500")
            _run("ip", "-n", self.hub, "link", "set", "dev", peer, "gso_max_size", "1500")
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", self.hub, "link", "set", peer, "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", peer, "up")
            etc = NETNS_ETC / ns
            etc.mkdir()  # refuses one that appeared since the check: never someone else's
            _record(ns, etc_made=True)
            (etc / "hosts").write_text(f"{address(i)} {hostname}\n127.0.0.1 localhost\n")

    def _add(self, ns: str) -> None:
        """Create namespace ``ns`` and record it as this cluster's, with SIGINT and SIGTERM
        held so that it is never made without its record (nor recorded unmade: a name
        another process holds fails here and is not touched by :meth:`close`)."""
        import signal

        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            _run("ip", "netns", "add", ns)
            _record(ns, etc_made=False)
            self._made.append(ns)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def shape(self, rate_mbit: float | None) -> None:
        """(Re)shape every link to ``rate_mbit`` each way (None: remove the limits)."""
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit!r}")
        for i, ns in enumerate(self.hosts):
            for where, dev in ((ns, f"{self.prefix}v{i}"), (self.hub, f"{self.prefix}b{i}")):
                subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True)  # fmt: skip
                if rate_mbit is None:
                    continue
                # Bucket of 0.25 ms at the rate, at least two full frames: a message
                # passes at line rate only for its first bucket (3 KB at 100 Mbit/s,
                # 31 KB at 1 Gbit/s) after an idle gap. Queue up to 200 ms.
                burst = max(2 * 1514, int(rate_mbit * 1e6 / 8 * 0.00025))
                _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                     f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms")  # fmt: skip
        self.rate_mbit = rate_mbit

    def exec_prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.hosts[i]]

    def close(self) -> None:
        """Delete every namespace (their links go with them) and ``/etc/netns`` file made;
        SIGINT and SIGTERM wait until it is done."""
        import signal

        blocked = {signal.SIGINT, signal.SIGTERM}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            failed = [e for e in (_remove(ns) for ns in reversed(self._made)) if e]
            self._made = []
            if self._etc_root_made and NETNS_ETC.is_dir() and not any(NETNS_ETC.iterdir()):
                NETNS_ETC.rmdir()
                self._etc_root_made = False
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if failed:
            raise RuntimeError("could not delete namespaces: " + "; ".join(failed))

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ECHO = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    head = c.recv(8, socket.MSG_WAITALL)
    if len(head) < 8: break
    n = int.from_bytes(head, "little"); got = 0
    while got < n:
        chunk = c.recv(min(1 << 20, n - got))
        if not chunk: sys.exit(1)
        got += len(chunk)
    c.sendall(b"k")
"""

_PING = r"""
import socket, sys, time, json
host, port, sizes, reps = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = {}
for n in sizes:
    buf = b"x" * n; times = []
    for _ in range(reps):
        t = time.perf_counter(); c.sendall(n.to_bytes(8, "little") + buf)
        assert c.recv(1) == b"k"; times.append(time.perf_counter() - t)
    out[n] = sorted(times)[len(times) // 2]
print(json.dumps(out))
"""


def ping_pong(
    cluster: NetnsCluster, sizes: Sequence[int] = (1, 65536, 1 << 20, 4 << 20), reps: int = 5
) -> dict[str, float]:
    """Message times from host 0 to host 1 over TCP and the alpha-beta figures they give:
    ``{"alpha_s", "beta_s_per_byte", "bandwidth_bps", "times": {bytes: s}}``.

    Each size's time is the median of ``reps`` sends, each waiting for a 1-byte reply (so a
    time is one message plus a round trip's fixed cost, as a blocking collective round pays
    it). ``alpha`` is the time of the smallest size; ``beta`` the slope of a line through the
    sizes of at least 1 MB (the token bucket lets smaller messages pass at the veth's own
    speed, which would bend a fit over every size).
    """
    if cluster.n < 2:
        raise ValueError("ping_pong needs a cluster of at least 2 hosts")
    port = 15000 + os.getpid() % 1000
    echo = subprocess.Popen(
        [*cluster.exec_prefix(1), sys.executable, "-c", _ECHO, address(1), str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        import json

        proc = subprocess.run(
            [*cluster.exec_prefix(0), sys.executable, "-c", _PING, address(1), str(port),
             json.dumps(list(sizes)), str(reps)],
            capture_output=True, text=True, check=True, timeout=600,
        )  # fmt: skip
        times = {int(k): float(v) for k, v in json.loads(proc.stdout).items()}
    finally:
        echo.kill()
        echo.wait()
    big = np.array([k for k in sorted(times) if k >= 1 << 20], np.float64)
    if len(big) < 2:
        raise ValueError(f"sizes must include at least two of >= 1 MB, got {sorted(times)}")
    beta = float(np.polyfit(big, [times[int(k)] for k in big], 1)[0])
    alpha = times[min(times)]
    return {
        "alpha_s": float(alpha),
        "beta_s_per_byte": float(beta),
        "bandwidth_bps": float(8 / beta) if beta > 0 else float("inf"),
        "times": {str(k): v for k, v in sorted(times.items())},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m train.netns --cleanup``: delete what a killed cluster left behind."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"{RUN}.netns", description=main.__doc__)
    parser.add_argument("--cleanup", action="store_true", help="delete recorded leftovers")
    args = parser.parse_args(argv)
    if not args.cleanup:
        parser.print_help()
        return 2
    names = cleanup()
    print(f"deleted {len(names)} namespace(s): {', '.join(names) or 'none left'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
