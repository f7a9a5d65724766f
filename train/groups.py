"""Start a run as replica groups on this machine: ``python -m train.groups --groups N``.

Starts a torchft lighthouse, then ``N`` group processes, each ``python -m train`` with the
given config and ``groups.{lighthouse,slot,count}`` set, its run folder
``<run_dir>/group_<i>``; waits for them and writes ``<run_dir>/summary.json`` (each group's
exit code, restarts, steps, validation loss, exchanges, heals, bytes sent and compute
utilisation, and the run's wall time). Groups on other machines run the same
``python -m train`` command against this lighthouse (``--set groups.host=<their address>``).

``--network 50ms,100Mbps`` (or a rate in Mbit/s alone) runs each group in a network
namespace of its own, joined to the others by a link shaped to that rate each way
(:class:`train.netns.NetnsCluster`; root, Linux; the kernel here has no ``netem``, so the
delay is not added), the lighthouse on one more host;
the summary then records the bytes each group's link carried (the kernel's counter),
beside what each group's transport counted.

``--chaos-every S`` kills a random training group with SIGKILL every ``S`` seconds (never
the last one alive) and starts it again ``--restart-after`` seconds later (from its own
newest checkpoint if it has one; either way the live groups heal it), to measure what
failures cost (``benchmarks/groups_chaos.py``). ``--spare`` hands each restart to a hot
spare (:class:`Spare`) whose libraries are already loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["Forked", "Spare", "group_args", "main", "pinned", "start_group"]

SPARE_LOAD_S = 120  # seconds a hot spare may take to load its libraries


def group_args(
    slot: int,
    count: int,
    lighthouse: str,
    run_dir: Path,
    config: str | None,
    overrides: list[str],
    *,
    resume: bool = False,
) -> list[str]:
    """The arguments of ``python -m train`` for group ``slot`` of ``count``, its run folder
    ``<run_dir>/group_<slot>`` (``--resume`` where that folder has a checkpoint)."""
    folder = run_dir / f"group_{slot}"
    args = ["--no-progress", *(["--config", config] if config else [])]
    sets = [*overrides, f"groups.lighthouse={lighthouse}", f"groups.slot={slot}",
            f"groups.count={count}", f"out_dir={folder}", f"name=group_{slot}"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    saved = folder / "checkpoints"
    if resume and saved.is_dir() and any(p.name.isdigit() for p in saved.iterdir()):
        args += ["--resume"]
    return args


#: How long the launcher waits for a lighthouse in its network namespace to be up (seconds).
LIGHTHOUSE_START_S = 60


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
    cpus: set[int] | None = None,
    processes: int = 1,
) -> subprocess.Popen:
    """Start group ``slot`` of ``count`` (``python -m train``, after the command ``prefix``,
    e.g. a network namespace's), its output in ``<run_dir>/group_<slot>.log``; ``cpus``:
    the CPU cores it may run on (all: None); ``processes``: more than 1 makes the group
    one ``jax.distributed`` job of that many processes (``python -m train.launch``)."""
    args = group_args(slot, count, lighthouse, run_dir, config, overrides, resume=resume)
    package = __package__ or "train"
    run = ["-m", package] if processes == 1 else ["-m", f"{package}.launch", "--processes",
                                                  str(processes)]  # fmt: skip
    cmd = [*(prefix or []), sys.executable, *run, *args]
    log = open(run_dir / f"group_{slot}.log", "a")
    if cpus is not None:
        cmd = pinned(cmd, cpus)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def can_leave_idle() -> bool:
    """Whether a process of this user may go back from ``SCHED_IDLE`` to the normal class
    (root, or a ``RLIMIT_NICE`` that allows nice 0); Linux only."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


class Spare:
    """A hot spare: ``python -m train --standby`` started ahead, its libraries loaded, that
    forks a restarted group each time :meth:`take` hands it the group's arguments (one
    spare serves every restart of a run). It saves a restart the interpreter's start and
    the imports (torch, torchft, JAX and the trainer: about 7 s on one core); the group
    still compiles (from the run's persistent cache) and is healed from a live peer like
    any restart. It loads at the idle scheduling class (``SCHED_IDLE``: on a machine the
    groups keep busy it takes only the cycles they leave; ``idle=False``: the normal class
    throughout); the groups it forks run at the normal class."""

    def __init__(
        self, run_dir: Path, n: int, env: dict[str, str] | None = None, *, idle: bool | None = None
    ):
        self.order = run_dir / f"spare_{n}.json"
        self.log = run_dir / f"spare_{n}.log"
        self.taken = 0
        for old in run_dir.glob(f"spare_{n}.*"):
            if old != self.log:
                old.unlink()  # a reused run folder's: never taken for this one
        if idle is None:
            idle = can_leave_idle()
        code = ("import os, sys\nif hasattr(os, 'SCHED_IDLE'):\n"
                "    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
                "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")  # fmt: skip
        cmd = [sys.executable, *(["-c", code] if idle else []), "-m", __package__ or "train",
               "--standby", str(self.order)]  # fmt: skip
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def ready(self) -> bool:
        """Whether it has loaded its libraries and waits (and is alive)."""
        return self.proc.poll() is None and Path(f"{self.order}.ready").is_file()

    def take(
        self, args: list[str], log: Path, cpus: set[int] | None, timeout_s: float = 30.0
    ) -> Forked:
        """Hand it ``python -m train``'s arguments ``args``: a fork of it runs them, its
        output appended to ``log``, on the cores ``cpus`` (all: None). Returns the fork's
        handle once the spare names its pid (RuntimeError if the spare ends first or
        takes more than ``timeout_s`` seconds)."""
        key = self.taken
        order = {"id": key, "argv": args, "log": str(log),
                 "cpus": sorted(cpus) if cpus else None}  # fmt: skip
        tmp = self.order.with_suffix(".tmp")
        tmp.write_text(json.dumps(order))
        tmp.replace(self.order)  # whole, or not there
        pid_file = Path(f"{self.order}.{key}.pid")
        end = time.monotonic() + timeout_s
        while not pid_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > end:
                try:  # withdrawn, so that a late spare cannot start the group a second time
                    self.order.unlink()
                except FileNotFoundError:
                    if self.proc.poll() is None:  # taken just now: its pid is on the way
                        end += timeout_s
                        continue
                raise RuntimeError(f"the hot spare did not fork the group within {timeout_s:g} "
                                   f"s (exit code {self.proc.poll()}; {self.log})")  # fmt: skip
            time.sleep(0.01)
        self.taken += 1
        return Forked(int(pid_file.read_text()), Path(f"{self.order}.{key}.rc"), self.proc)

    def stop(self) -> None:
        """End it (a spare has nothing to save; the groups it forked go on)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Forked:
    """A group a :class:`Spare` forked, with the part of :class:`subprocess.Popen`'s
    interface the launcher uses: its exit code comes from the spare, which reaps it."""

    def __init__(self, pid: int, rc_file: Path, spare: subprocess.Popen):
        self.pid, self.rc_file, self.spare = pid, rc_file, spare
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code, or None while it runs. Should the spare die first, a fork that
        is gone counts as killed (``-9``): nobody is left to say how it ended."""
        if self.returncode is None:
            if self.rc_file.is_file():
                self.returncode = int(self.rc_file.read_text())
            elif self.spare.poll() is not None and not _alive(self.pid):
                self.returncode = -int(signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ends (``subprocess.TimeoutExpired`` after ``timeout`` s)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` (nothing once it has ended)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL it."""
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def pinned(cmd: list[str], cpus: set[int]) -> list[str]:
    """``cmd`` (its first ``sys.executable`` on) run on the CPU cores ``cpus`` only: a
    Python that sets its affinity and execs the rest (inherited across exec; no fork-time
    hook in this threaded launcher)."""
    at = cmd.index(sys.executable)
    code = (
        "import os, sys; os.sched_setaffinity(0, {%s}); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    wrap = [sys.executable, "-c", code % ", ".join(str(c) for c in sorted(cpus))]
    # sys.argv of ``-c`` is ["-c", *rest]; argv[0] must name the interpreter (a virtual
    # environment is found from it).
    return [*cmd[:at], *wrap, *cmd[at + 1 :]]


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
    p.add_argument("--chaos-every-steps", type=int, default=0, metavar="K",
                   help="kill a group each time the run's step (the furthest live group's) "
                   "has gone K more steps, plus a random 0-9, since the last kill (the "
                   "schedule of benchmarks/elastic_chaos.py); not with --chaos-every",
                   )  # fmt: skip
    p.add_argument("--restart-after", type=float, default=5.0, help="restart a killed group")
    p.add_argument("--chaos-seed", type=int, default=0)
    p.add_argument("--processes-per-group", type=int, default=1, metavar="P",
                   help="each group one jax.distributed job of P processes (python -m "
                   "train.launch); its first process talks to the other groups")  # fmt: skip
    p.add_argument("--spare", action="store_true",
                   help="keep a hot spare (libraries loaded, before the groups start) that forks "
                   "every restarted group")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="resume every group's run folder")
    p.add_argument("--network", default=None, metavar="LAT,BW",
                   help="each group in a network namespace, its link shaped to BW "
                   "(e.g. 50ms,100Mbps; without netem LAT is not added)")  # fmt: skip
    p.add_argument("--cpus-per-group", type=int, default=0, metavar="K",
                   help="pin group i to K cores of its own (the i-th K of the cores this "
                   "launcher may use), as if each group had a machine; 0: no pinning")  # fmt: skip
    args = p.parse_args(argv)
    if args.groups < 1:
        p.error(f"--groups must be at least 1, got {args.groups}")
    if args.chaos_every_steps < 0 or (args.chaos_every_steps and args.chaos_every):
        p.error(f"--chaos-every-steps must be a positive count of steps, not with "
                f"--chaos-every; got {args.chaos_every_steps} (and --chaos-every "
                f"{args.chaos_every:g})")  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))
    if args.cpus_per_group < 0 or args.cpus_per_group * args.groups > len(cores):
        p.error(f"--cpus-per-group {args.cpus_per_group} x --groups {args.groups} needs "
                f"{args.cpus_per_group * args.groups} cores and K >= 0; this process may "
                f"use {len(cores)}")  # fmt: skip
    if not 1 <= args.min_groups <= args.groups:
        p.error(f"--min-groups must be in 1..{args.groups}, got {args.min_groups}")
    if args.processes_per_group < 1:
        p.error(f"--processes-per-group must be at least 1, got {args.processes_per_group}")
    if args.spare and args.processes_per_group > 1:
        p.error("--spare with --processes-per-group > 1: a spare is one process")
    if args.spare and args.network is not None:
        p.error("--spare with --network: a spare cannot enter a group's network namespace "
                "once started; use one or the other")  # fmt: skip
    mbit = None
    if args.network is not None:
        from jaxcomm._src.network import Network

        try:
            text = args.network if "," in args.network else f"0ms,{args.network}Mbps"
            net = Network.parse(text)
        except ValueError as e:
            p.error(f"--network {args.network!r}: {e}")
        mbit = net.bandwidth_bps / 1e6
        if net.latency_s:
            ms = 1e3 * net.latency_s
            print(f"--network: links shaped to {mbit:g} Mbit/s; the {ms:g} ms delay is not "
                  "added (no netem qdisc on this kernel)", file=sys.stderr)  # fmt: skip
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
    # Every group compiles the same programs: JAX's persistent cache (one folder for the
    # run) makes a restarted group's compilation a read.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(run_dir.resolve() / ".jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    cluster, lh, lh_proc = None, None, None
    prefixes: dict[int, list[str]] = {}
    sets = list(args.overrides)
    if mbit is not None:
        from .netns import NetnsCluster, address

        cluster = NetnsCluster(args.groups + 1, mbit, prefix="jxg")
        port = 29510
        code = (f"import time; from {__package__ or 'train'}.replica import lighthouse; "
                f"lh = lighthouse('[::]:{port}', {args.min_groups}, grace_ms={args.grace_ms}, "
                f"heartbeat_ms={args.heartbeat_ms}); print('ready', flush=True); "
                "time.sleep(10**9)")  # fmt: skip
        lh_proc = subprocess.Popen(
            [*cluster.exec_prefix(args.groups), sys.executable, "-c", code], env=env,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        lh_address = f"http://{address(args.groups)}:{port}"
        prefixes = {i: cluster.exec_prefix(i) for i in range(args.groups)}
        # Up once it says so (its imports take seconds); its error, if any, is printed above.
        ready, _, _ = select.select([lh_proc.stdout], [], [], LIGHTHOUSE_START_S)
        if (lh_proc.stdout.readline().strip() if ready else "") != "ready":
            lh_proc.kill()
            code = lh_proc.wait()
            cluster.close()
            why = f"exited with code {code}" if ready else f"was not up in {LIGHTHOUSE_START_S} s"
            print(f"error: the lighthouse in its network namespace {why}", file=sys.stderr)
            return 2
    else:
        port = free_port()
        try:
            lh = lighthouse(
                f"[::]:{port}", args.min_groups, grace_ms=args.grace_ms,
                heartbeat_ms=args.heartbeat_ms,
            )  # fmt: skip
        except OSError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        lh_address = f"http://127.0.0.1:{port}"

    def begin(i: int, resume: bool, rejoin: bool = False) -> subprocess.Popen:
        own = [f"groups.host={address(i)}"] if cluster is not None else []
        own += ["groups.rejoin=true"] if rejoin else []
        k = args.cpus_per_group
        cpus = set(cores[i * k : (i + 1) * k]) if k else None
        return start_group(i, args.groups, lh_address, run_dir, args.config, [*sets, *own],
                           resume=resume, env=env, prefix=prefixes.get(i), cpus=cpus,
                           processes=args.processes_per_group)  # fmt: skip

    spares = []
    if args.spare:  # loaded before the groups start, at the normal class: one for the run
        spares.append(Spare(run_dir, 0, env, idle=False))
        end = time.monotonic() + SPARE_LOAD_S
        while not spares[0].ready():
            if spares[0].proc.poll() is not None or time.monotonic() > end:
                print(f"error: the hot spare did not load within {SPARE_LOAD_S} s (exit code "
                      f"{spares[0].proc.poll()}; {spares[0].log})", file=sys.stderr)  # fmt: skip
                spares[0].stop()
                if lh is not None:
                    lh.shutdown()
                if cluster is not None:
                    lh_proc.kill()
                    cluster.close()
                return 1
            time.sleep(0.05)
    start, started = time.monotonic(), time.time()
    procs = {i: begin(i, args.resume) for i in range(args.groups)}

    def restart(i: int) -> tuple[subprocess.Popen | Forked, str]:
        """Group ``i`` started again: forked by the spare where it is ready."""
        if spares and spares[-1].proc.poll() is not None:
            print(f"the hot spare ended ({spares[-1].proc.returncode}; {spares[-1].log}); "
                  "starting another", flush=True)  # fmt: skip
            spares.append(Spare(run_dir, len(spares), env))
        if spares and spares[-1].ready():
            k = args.cpus_per_group
            cpus = set(cores[i * k : (i + 1) * k]) if k else None
            own = group_args(i, args.groups, lh_address, run_dir, args.config,
                             [*sets, "groups.rejoin=true"], resume=True)  # fmt: skip
            try:
                return spares[-1].take(own, run_dir / f"group_{i}.log", cpus), " on the hot spare"
            except RuntimeError as e:
                print(f"{e}; a cold start instead", flush=True)
        return begin(i, True, rejoin=True), ""

    started_at = {i: time.time() for i in procs}
    restarts = {i: 0 for i in procs}
    kills: list[dict] = []
    stopped: set[int] = set()  # restarted groups stopped because the run ended
    down: dict[int, float] = {}  # slot -> when to restart it
    rng = random.Random(args.chaos_seed)
    next_kill = start + (args.chaos_start or args.chaos_every) if args.chaos_every else None
    kill_step = None  # with --chaos-every-steps: the run's step of the next kill
    if args.chaos_every_steps:
        kill_step = args.chaos_every_steps + rng.randrange(10)
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
            # A group is killed only once it trains (a metrics row since its start).
            training = [i for i in live if _trains(run_dir / f"group_{i}", started_at[i])]
            # Once a group has finished the run is ending: no more kills, and a killed group
            # is not started again (it would train on alone).
            ending = bool(codes)
            if ending:  # a restarted group still waiting to be healed would wait in vain
                for i in live:
                    if restarts[i] and not _trains(run_dir / f"group_{i}", started_at[i]):
                        procs[i].send_signal(signal.SIGKILL)  # nothing of its own to save
                        stopped.add(i)
            due = next_kill is not None and now >= next_kill
            if kill_step is not None and training:
                reached = max(_step(run_dir / f"group_{i}") for i in training)
                due = reached >= kill_step
            # Never the last group training, nor while one is still on its way back (the
            # others must be there to heal it).
            if due and len(training) > 1 and len(training) == len(live) and not down and not ending:
                victim = rng.choice(training)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                down[victim] = now + args.restart_after
                at = f" (step {reached})" if kill_step is not None else ""
                print(f"chaos: killed group {victim} at {now - start:.1f} s{at}", flush=True)
                kills.append({"group": victim, "time": time.time()})
                if kill_step is not None:
                    kills[-1]["step"] = reached
                    kill_step = reached + args.chaos_every_steps + rng.randrange(10)
                else:
                    next_kill = now + args.chaos_every
            for i, when in list(down.items()):
                if ending:
                    del down[i]
                    codes[i] = -int(signal.SIGKILL)
                    print(f"chaos: group {i} stays down (the run is ending)", flush=True)
                elif now >= when:
                    del down[i]
                    restarts[i] += 1
                    procs[i], how = restart(i)
                    started_at[i] = time.time()
                    print(f"chaos: restarted group {i}{how} at {now - start:.1f} s", flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            proc.wait()
        return 130
    finally:
        for spare in spares:
            spare.stop()
        link = {}
        if cluster is not None:
            link = {i: _tx_bytes(cluster, i) for i in range(args.groups)}
            lh_proc.kill()
            lh_proc.wait()
            cluster.close()
        if lh is not None:
            lh.shutdown()
    wall = time.monotonic() - start
    report = {"groups": args.groups, "exit_codes": codes, "restarts": restarts, "wall_s": wall,
              "started": started, "kills": kills, "stopped": sorted(stopped),
              "lost_per_failure_s": lost_per_failure(run_dir, kills),
              "spares_taken": sum(s.taken for s in spares)}  # fmt: skip
    if link:
        report["link_tx_bytes"] = link
        report["network_mbit"] = mbit
    report["per_group"] = {i: _group_summary(run_dir / f"group_{i}") for i in range(args.groups)}
    (run_dir / "summary.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "per_group"}))
    for i, g in report["per_group"].items():
        if g:
            print(f"group {i}: " + ", ".join(f"{k} {v}" for k, v in g.items()))
    if stopped:
        print(f"groups {sorted(stopped)} were stopped before a live group could heal them "
              "(the run ended)", flush=True)  # fmt: skip
    counted = [c for i, c in codes.items() if i not in stopped and c >= 0]
    return max(counted) if counted else 1


def _trains(folder: Path, since: float) -> bool:
    """Whether the group in ``folder`` has written a metrics row since ``since``."""
    path = folder / "metrics.jsonl"
    try:
        return path.stat().st_mtime > since and path.stat().st_size > 0
    except FileNotFoundError:
        return False


def _step(folder: Path) -> int:
    """The step of the last metrics row of the group in ``folder`` (0 before any)."""
    try:
        with open(folder / "metrics.jsonl", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 8192, 0))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a row being written, or the tail's first, cut line
    return 0


def lost_per_failure(folder: Path, kills: list[dict]) -> list[float]:
    """Seconds from each kill (``{"group", "time"}``, the summary's ``kills``) to the killed
    group's next exchange, the one that healed it (none for a group not back by the end)."""
    out = []
    for k in kills:
        path = folder / f"group_{k['group']}" / "exchanges.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        times = [json.loads(x)["time"] for x in lines]
        after = [t for t in times if t > k["time"]]
        if after:
            out.append(min(after) - k["time"])
    return out


def _group_summary(folder: Path) -> dict:
    """A group's line in the run's summary: from its own ``summary.json``."""
    try:
        s = json.loads((folder / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    g = s.get("groups", {})
    keys = ("exchanges", "heals", "failed", "left_out", "sent_bytes", "heal_sent_bytes",
            "utilisation", "wait_s")  # fmt: skip
    return {"steps": s.get("steps"), "valid_loss": s.get("valid_loss"),
            **{k: g.get(k) for k in keys}}  # fmt: skip


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
