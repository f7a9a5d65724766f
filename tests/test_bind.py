"""Where a multi-process run listens: a local launch keeps every port on loopback, also where
the machine's host name resolves to a network address (a test namespace, root needed)."""

import ipaddress
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest
from conftest import child_env

from train import netns

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHY = netns.available()


def _net_ns(pid):
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:  # ended meanwhile
        return None


def _listening(pid):
    """The ``(address, port)`` of every TCP socket listening in ``pid``'s network namespace
    (none once ``pid`` has ended)."""
    found = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        try:
            text = pathlib.Path(f"/proc/{pid}/net/{name}").read_text()
        except OSError:
            continue
        for row in text.splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = local.split(":")
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(bytes.fromhex(hexaddr[k : k + 8])[::-1] for k in range(0, 2 * width, 8))
            found.add((ipaddress.ip_address(raw), int(hexport, 16)))
    return found


@pytest.mark.skipif(WHY is not None, reason=f"network namespaces: {WHY}")
def test_a_local_launch_listens_on_loopback_only_where_the_host_name_is_on_the_network(
    tmp_path,
):
    """``python -m train.launch --processes 2`` inside a namespace whose ``/etc/hosts``
    resolves this machine's host name to 198.18.0.1 (as a LAN address would): every TCP
    socket listening there while the processes train (the coordinator, each process's
    gloo) is on loopback."""
    run = tmp_path / "run"
    sets = ["steps=3", "model.num_layers=1", "model.width=32", "model.seq_len=16",
            "workers=2", "global_batch=8", "checkpoint_every=0", "eval_every=0",
            "progress=false", f"out_dir={run}"]  # fmt: skip
    args = ["--processes", "2", "--config", "configs/dp_default.yaml"]
    for s in sets:
        args += ["--set", s]
    log = tmp_path / "launch.log"
    with netns.NetnsCluster(1, None, prefix="jb") as c, open(log, "w") as out:
        resolved = subprocess.run(
            [*c.exec_prefix(0), "getent", "hosts", socket.gethostname()],
            capture_output=True,
            text=True,
        ).stdout
        assert resolved.startswith(netns.address(0)), resolved  # the namespace's premise
        proc = subprocess.Popen(
            [*c.exec_prefix(0), sys.executable, "-m", "train.launch", *args],
            cwd=ROOT,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        seen = set()
        try:
            # `ip netns exec` enters the namespace and then runs the launcher as the same
            # process: only from then on does /proc/<pid>/net show the namespace's sockets.
            inside = os.stat(f"/run/netns/{c.hosts[0]}").st_ino
            deadline = time.monotonic() + 600
            while proc.poll() is None and _net_ns(proc.pid) != inside:
                assert time.monotonic() < deadline, "the launcher never entered the namespace"
                time.sleep(0.01)
            # Every socket listening at any time of the run, until the launcher ends.
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the run did not end"
                seen |= _listening(proc.pid)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    # The coordinator and the two processes' gloo at least.
    assert len(seen) >= 3, seen
    exposed = sorted(f"{a}:{p}" for a, p in seen if not a.is_loopback)
    assert not exposed, f"listening off loopback: {exposed}"


def test_listening_sockets_are_read_from_proc():
    """The reader of /proc/<pid>/net/tcp finds a socket this process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert (ipaddress.ip_address("127.0.0.1"), s.getsockname()[1]) in _listening(os.getpid())


def test_where_gloo_listens():
    """Loopback for a local coordinator; JAX's default (the host name's address) for a
    cluster; the user's host or interface wherever given; not both."""
    from train.distributed import gloo_address

    assert gloo_address({}, "127.0.0.1") == ("127.0.0.1", None)
    assert gloo_address({}, "localhost") == ("localhost", None)
    assert gloo_address({}, "[::1]") == ("::1", None)
    assert gloo_address({}, "10.0.0.5") is None
    assert gloo_address({}) is None  # JAXCOMM_DISTRIBUTED=auto
    assert gloo_address({"JAXCOMM_GLOO_HOST": "10.0.0.5"}, "10.0.0.1") == ("10.0.0.5", None)
    assert gloo_address({"JAXCOMM_GLOO_INTERFACE": "eth1"}) == (None, "eth1")
    assert gloo_address({"JAXCOMM_GLOO_HOST": "[fd00::5]"}, "127.0.0.1") == ("fd00::5", None)
    with pytest.raises(ValueError, match="JAXCOMM_GLOO_HOST or JAXCOMM_GLOO_INTERFACE, not"):
        gloo_address({"JAXCOMM_GLOO_HOST": "10.0.0.5", "JAXCOMM_GLOO_INTERFACE": "eth1"})


def test_a_jax_without_the_internals_is_a_clear_error(monkeypatch):
    from jax._src import xla_bridge

    from train import distributed

    monkeypatch.setattr(xla_bridge, "_backend_factories", {})
    with pytest.raises(RuntimeError, match="cannot make gloo listen on host '127.0.0.1' with JAX"):
        distributed._gloo_listener("127.0.0.1", None)


# One process of a multi-process run (a world of one): starts jax.distributed and its CPU
# backend, says so, and holds them until its input closes.
_ONE = """
import sys
from train import distributed
distributed.initialize()
import jax
jax.devices()
print("up", flush=True)
sys.stdin.read()
"""


def _one_process(prefix=(), **env):
    from train.launch import free_port

    env = {**child_env(), "JAXCOMM_COORDINATOR": f"127.0.0.1:{free_port()}",
           "JAXCOMM_NUM_PROCESSES": "1", "JAXCOMM_PROCESS_ID": "0", **env}  # fmt: skip
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", _ONE],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_an_interface_gloo_cannot_listen_on_is_named():
    proc = _one_process(JAXCOMM_GLOO_INTERFACE="nosuch0")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "gloo cannot listen on interface 'nosuch0'" in err, err[-2000:]
    assert "set JAXCOMM_GLOO_HOST to an address of this machine" in err


@pytest.mark.skipif(WHY is not None, reason=f"network namespaces: {WHY}")
@pytest.mark.parametrize("choice", ["JAXCOMM_GLOO_INTERFACE", "JAXCOMM_GLOO_HOST"])
def test_gloo_listens_where_the_user_says(choice):
    """In a namespace whose network address is 198.18.0.1, gloo listens there when told by
    interface or by address (the coordinator stays on loopback)."""
    with netns.NetnsCluster(1, None, prefix="jb") as c:
        value = f"{c.prefix}v0" if choice == "JAXCOMM_GLOO_INTERFACE" else netns.address(0)
        proc = _one_process(c.exec_prefix(0), **{choice: value})
        try:
            line = proc.stdout.readline()
            assert line.strip() == "up", proc.stderr.read()[-2000:]
            seen = _listening(proc.pid)
        finally:
            proc.stdin.close()
            proc.wait(timeout=120)
    assert {a for a, _ in seen} == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address(netns.address(0)),
    }, seen
