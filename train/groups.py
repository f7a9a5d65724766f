"""Start a run as replica groups on this machine: ``python -m train.groups --groups N``.

Starts a torchft lighthouse, then ``N`` group processes, each ``python -m train`` with the
given config and ``groups.{lighthouse,slot,count}`` set, its run folder
``<run_dir>/group_<i>``; waits for them and writes ``<run_dir>/groups.json`` (each group's
exit code, restarts and the run's wall time). Groups on other machines run the same
``python -m train`` command against this lighthouse (``--set groups.host=<their address>``).

``--network MBIT`` runs each group in a network namespace of its own, joined to the others
by a link shaped to ``MBIT`` Mbit/s each way (:class:`train.netns.NetnsCluster`; root,
Linux), the lighthouse on one more host; ``groups.json`` then records the bytes each group's
link carried (the kernel's counter), beside what each group's transport counted.

``--chaos-every S`` kills a random training group with SIGKILL every ``S`` seconds (never
the last one alive) and starts it again ``--restart-after`` seconds later (from its own
newest checkpoint if it has one; either way the live groups heal it), to measure what
failures cost (``benchmarks/groups_chaos.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "start_group"]


def start_group(
    slot: int,
    count: int,
    lighthouse: str,
    run_dir: Path,
    config: str | None,
    overrides: list[str],
    *,
    resume: bool = False,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> subprocess.Popen:
    """Start group ``slot`` of ``count`` (``python -m train``, after the command ``prefix``,
    e.g. a network namespace's), its output in ``<run_dir>/group_<slot>.log``."""
    folder = run_dir / f"group_{slot}"
    cmd = [*(prefix or []), sys.executable, "-m", __package__ or "train", "--no-progress"]
    cmd += ["--config", config] if config else []
    sets = [*overrides, f"groups.lighthouse={lighthouse}", f"groups.slot={slot}",
            f"groups.count={count}", f"out_dir={folder}", f"name=group_{slot}"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    if resume and (folder / "checkpoints").is_dir():
        cmd += ["--resume"]
    log = open(run_dir / f"group_{slot}.log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.groups", description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, required=True, help="replica groups to start")
    p.add_argument("--config", help="YAML config of every group (with sync: diloco)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="the run folder (default runs/<name>_groups)")
    p.add_argument("--min-groups", type=int, default=1, help="the smallest quorum")
    p.add_argument("--grace-ms", type=int, default=1000, help="a quorum's wait for late groups")
    p.add_argument("--heartbeat-ms", type=int, default=3000, help="silence that drops a group")
    p.add_argument("--chaos-every", type=float, default=0.0, help="kill a group every S seconds")
    p.add_argument("--chaos-start", type=float, default=0.0, help="first kill after S seconds")
    p.add_argument("--restart-after", type=float, default=5.0, help="restart a killed group")
    p.add_argument("--chaos-seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="resume every group's run folder")
    p.add_argument("--network", type=float, default=None, metavar="MBIT",
                   help="each group in a network namespace, links of MBIT Mbit/s")  # fmt: skip
    args = p.parse_args(argv)
    if args.groups < 1:
        p.error(f"--groups must be at least 1, got {args.groups}")
    if not 1 <= args.min_groups <= args.groups:
        p.error(f"--min-groups must be in 1..{args.groups}, got {args.min_groups}")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum
    from .config import load_config
    from .distributed import free_port
    from .replica import lighthouse

    try:
        # Every group's settings, checked once here (the lighthouse is not up yet).
        check = [
            "groups.lighthouse=http://127.0.0.1:1",
            "groups.slot=0",
            f"groups.count={args.groups}",
        ]
        cfg = load_config(args.config, [*args.overrides, *check])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(args.out or f"runs/{cfg.name}_groups")
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    cluster, lh, lh_proc = None, None, None
    prefixes: dict[int, list[str]] = {}
    sets = list(args.overrides)
    if args.network is not None:
        from .netns import NetnsCluster, address

        cluster = NetnsCluster(args.groups + 1, args.network, prefix="jxg")
        port = 29510
        code = (f"import time; from {__package__ or 'train'}.replica import lighthouse; "
                f"lh = lighthouse('[::]:{port}', {args.min_groups}, grace_ms={args.grace_ms}, "
                f"heartbeat_ms={args.heartbeat_ms}); time.sleep(10**9)")  # fmt: skip
        lh_proc = subprocess.Popen(
            [*cluster.exec_prefix(args.groups), sys.executable, "-c", code], env=env
        )
        lh_address = f"http://{address(args.groups)}:{port}"
        prefixes = {i: cluster.exec_prefix(i) for i in range(args.groups)}
        time.sleep(1.0)
    else:
        port = free_port()
        lh = lighthouse(
            f"[::]:{port}", args.min_groups, grace_ms=args.grace_ms, heartbeat_ms=args.heartbeat_ms
        )
        lh_address = f"http://127.0.0.1:{port}"

    def begin(i: int, resume: bool) -> subprocess.Popen:
        own = [f"groups.host={address(i)}"] if cluster is not None else []
        return start_group(i, args.groups, lh_address, run_dir, args.config, [*sets, *own],
                           resume=resume, env=env, prefix=prefixes.get(i))  # fmt: skip

    start = time.monotonic()
    procs = {i: begin(i, args.resume) for i in range(args.groups)}
    restarts = {i: 0 for i in procs}
    down: dict[int, float] = {}  # slot -> when to restart it
    rng = random.Random(args.chaos_seed)
    next_kill = start + (args.chaos_start or args.chaos_every) if args.chaos_every else None
    codes: dict[int, int] = {}
    try:
        while len(codes) < args.groups:
            now = time.monotonic()
            for i, proc in list(procs.items()):
                if i in codes or i in down:
                    continue
                rc = proc.poll()
                if rc is not None:
                    codes[i] = rc
            live = [i for i in procs if i not in codes and i not in down]
            # Once a group has finished the run is ending: no more kills, and a killed group
            # is not started again (it would train on alone).
            ending = bool(codes)
            if (
                next_kill is not None
                and now >= next_kill
                and len(live) > 1
                and not down
                and not ending
            ):
                victim = rng.choice(live)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                down[victim] = now + args.restart_after
                print(f"chaos: killed group {victim} at {now - start:.1f} s", flush=True)
                next_kill = now + args.chaos_every
            for i, when in list(down.items()):
                if ending:
                    del down[i]
                    codes[i] = -int(signal.SIGKILL)
                    print(f"chaos: group {i} stays down (the run is ending)", flush=True)
                elif now >= when:
                    del down[i]
                    restarts[i] += 1
                    procs[i] = begin(i, True)
                    print(f"chaos: restarted group {i} at {now - start:.1f} s", flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            proc.wait()
        return 130
    finally:
        link = {}
        if cluster is not None:
            link = {i: _tx_bytes(cluster, i) for i in range(args.groups)}
            lh_proc.kill()
            lh_proc.wait()
            cluster.close()
        if lh is not None:
            lh.shutdown()
    wall = time.monotonic() - start
    report = {"groups": args.groups, "exit_codes": codes, "restarts": restarts, "wall_s": wall}
    if link:
        report["link_tx_bytes"] = link
        report["network_mbit"] = args.network
    (run_dir / "groups.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return max(codes.values()) if codes else 1


def _tx_bytes(cluster, i: int) -> int:
    """Bytes host ``i`` sent on its link (the kernel's counter of its veth)."""
    dev = f"{cluster.prefix}v{i}"
    out = subprocess.run(
        [*cluster.exec_prefix(i), "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
