"""Namespaced test hosts on shaped veth links (root, ``ip`` and ``tc`` needed; else skipped)."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import child_env
from flax import serialization

from train import netns
from train.launch import free_port, launch

WHY = netns.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"network namespaces: {WHY}")
PREFIX = "jt"


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _mine():
    return {n for n in _namespaces() if n.startswith(PREFIX)}


def test_hosts_have_test_addresses_only_and_are_torn_down():
    with netns.NetnsCluster(3, None, prefix=PREFIX) as c:
        assert _mine() == {"jt0", "jt1", "jt2", "jthub"}
        addr = subprocess.run(["ip", "-n", "jt2", "-o", "addr"], capture_output=True, text=True)
        assert "198.18.0.3/24" in addr.stdout
        routes = subprocess.run(["ip", "-n", "jt2", "route"], capture_output=True, text=True)
        assert "default" not in routes.stdout  # no route off the test network
        hosts = (netns.NETNS_ETC / "jt1" / "hosts").read_text()
        assert hosts.startswith("198.18.0.2 ")
        ping = subprocess.run(
            [*c.exec_prefix(0), sys.executable, "-c",
             "import socket; s = socket.create_connection(('198.18.0.1', 9), timeout=10)"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert "ConnectionRefused" in ping.stderr  # reachable, nothing listening
    assert _mine() == set()
    assert not (netns.NETNS_ETC / "jt1").exists()


def test_torn_down_when_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.NetnsCluster(2, 100, prefix=PREFIX):
            raise RuntimeError("boom")
    assert _mine() == set()


def test_refuses_namespaces_that_exist():
    with netns.NetnsCluster(1, None, prefix=PREFIX):
        with pytest.raises(RuntimeError, match="already exist"):
            netns.NetnsCluster(1, None, prefix=PREFIX)
    assert _mine() == set()
    with pytest.raises(ValueError, match="rate_mbit"):
        netns.NetnsCluster(1, -5, prefix=PREFIX)
    assert _mine() == set()


def test_tbf_limits_the_link_rate():
    with netns.NetnsCluster(2, 100, prefix=PREFIX) as c:
        shaped = netns.ping_pong(c, reps=3)
        c.shape(None)
        free = netns.ping_pong(c, reps=3)
    assert 80e6 < shaped["bandwidth_bps"] < 105e6, shaped
    assert free["bandwidth_bps"] > 4 * shaped["bandwidth_bps"], free


def test_training_with_one_process_per_namespace(tmp_path):
    """Two processes in two namespaces (gloo over the shaped veth links) end with the
    parameters of one process with two devices."""
    sets = ["task=mlp", "model={features: [32]}", "dataset=digits", "workers=2",
            "global_batch=16", "steps=5", "aggregator=ring", "optimizer=sgd", "lr=0.05",
            "checkpoint_every=0", "eval_every=0", "progress=false"]  # fmt: skip

    def args(out):
        a = []
        for s in [*sets, f"out_dir={out}"]:
            a += ["--set", s]
        return a

    two, one = tmp_path / "two", tmp_path / "one"
    env = child_env()
    with netns.NetnsCluster(2, 100, prefix=PREFIX) as c:
        cmds = [[*c.exec_prefix(i), sys.executable, "-m", "train", *args(two)] for i in range(2)]
        rc = launch(2, [], devices_per_process=1, commands=cmds, host=netns.address(0),
                    port=free_port(), env=env)  # fmt: skip
    assert rc == 0
    single = subprocess.run([sys.executable, "-m", "train", *args(one)], env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert single.returncode == 0, single.stderr[-2000:]
    rows = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=1e-6)
    pa = jax.tree.leaves(serialization.msgpack_restore((two / "params.msgpack").read_bytes()))
    pb = jax.tree.leaves(serialization.msgpack_restore((one / "params.msgpack").read_bytes()))
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_a_preexisting_etc_folder_is_refused_and_left_alone():
    theirs = netns.NETNS_ETC / "jt0"
    theirs.mkdir(parents=True, exist_ok=True)
    (theirs / "resolv.conf").write_text("nameserver 198.18.0.99\n")
    try:
        with pytest.raises(RuntimeError, match="not made by this cluster"):
            netns.NetnsCluster(1, None, prefix=PREFIX)
        assert (theirs / "resolv.conf").read_text() == "nameserver 198.18.0.99\n"
        assert _mine() == set()
    finally:
        (theirs / "resolv.conf").unlink()
        theirs.rmdir()


def test_cleanup_removes_what_a_killed_cluster_left_and_nothing_else():
    """``kill -9`` of a process holding a cluster leaves its namespaces; the cleanup command
    deletes exactly those (and their /etc/netns folders), not a namespace it did not make."""
    subprocess.run(["ip", "netns", "add", "jtother"], check=True)
    try:
        code = ("import sys, time; from train import netns; "
                "c = netns.NetnsCluster(2, None, prefix='jt'); print('up', flush=True); "
                "time.sleep(120)")  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "up"
        proc.kill()
        proc.wait()
        assert {"jt0", "jt1", "jthub"} <= _mine()
        out = subprocess.run([sys.executable, "-m", "train.netns", "--cleanup"],
                             capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 0 and "jt0" in out.stdout
        assert _mine() == {"jtother"}
        assert not (netns.NETNS_ETC / "jt0").exists()
    finally:
        subprocess.run(["ip", "netns", "del", "jtother"])
