"""Start a multi-process training run on this machine.

    python -m train.launch --processes P [--port N] <the arguments of python -m train>
    python -m train.launch --processes P --min-processes M [--max-restarts R] ...

Starts ``P`` processes of ``python -m train`` with the given arguments, each with
``workers * stages / P`` CPU devices (``XLA_FLAGS``), wired to a coordinator on a free local
port (``JAXCOMM_COORDINATOR``, ``JAXCOMM_NUM_PROCESSES``, ``JAXCOMM_PROCESS_ID``; see
:mod:`train.distributed`). Every line the processes print comes out here prefixed with
``[p<i>]``. When a process fails, the others are stopped at once (they cannot go on
without it) and the launcher exits with the first failing exit code (``128 + n`` for a
process killed by signal ``n``), naming that process and the error it reported. A process
that prints ``error: ...`` (how ``python -m train`` reports a failure) has failed, also
while it still waits in JAX's shutdown for the others (exit code 1 then). Ctrl-C (or
SIGTERM, SIGHUP to the launcher) asks every process to stop: they finish the step under way,
save a checkpoint together and exit, and what is left after ``--grace`` seconds is killed.

Elastic (``--min-processes M``): when a process is lost (killed by a signal, as a lost
machine is), the others are stopped and the survivors restart from the newest checkpoint
on the largest world they can form, each keeping its devices (``workers`` = processes x
devices per process / stages, a divisor of the global batch; at least ``M`` processes), at
most ``--max-restarts`` times. The checkpoint's per-worker state is mapped onto the new
number of workers (:func:`jaxcomm.elastic.resize_workers`); the run continues at the same global
sample count. Compiled programs are kept in ``--compile-cache`` so a restart on a world
size seen before does not compile again.

On a real cluster, start one ``python -m train`` per host yourself with those variables set
(or ``JAXCOMM_DISTRIBUTED=auto`` where ``jax.distributed.initialize()`` detects the
cluster); see the README.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from . import RUN
from .cli import config_from_args
from .cli import parser as train_parser
from .distributed import (
    ENV_COORDINATOR,
    ENV_LAUNCHED,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    STOPPED_AT_ONCE,
    free_port,
)

__all__ = ["main", "free_port", "launch", "elastic", "Ended", "smaller_world"]


def _death_signal_setter():
    """A function for ``preexec_fn`` that asks the kernel to SIGKILL the child when the
    launcher dies, even by ``kill -9`` (which no handler of the launcher's sees), so no
    process trains on alone. ``prctl`` is looked up here, in the parent: the child between
    fork and exec only calls it. The signal follows the thread that started the child, so
    :func:`launch` runs its children from the thread that waits for them. None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def setter() -> None:
        if prctl(1, signal.SIGKILL) != 0:  # PR_SET_PDEATHSIG
            os._exit(125)
        if os.getppid() != parent:  # the launcher died before the request took hold
            os._exit(125)

    return setter


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


# What gloo prints once per pair of processes as they connect: noise unless --verbose. Its
# threads interleave their writes, so a line may hold a piece of one: each piece goes.
_GLOO_CONNECTED = re.compile(
    r"(\[Gloo\] )?(Rank )?\d+ is connected to \d+ peer ranks\.?"
    r"( Expected number of connected peer ranks is : \d+)?"
)
_GLOO_LEFTOVER = re.compile(r"^(\s|\[Gloo\]|Rank)*$")


def _pump(i: int, stream, out: queue.Queue, quiet: bool = True) -> None:
    """Relay ``stream`` (bytes) as text pieces, each ending in ``\n`` or in ``\r`` (a
    progress bar's redraw, relayed as a redraw, not as a line of its own)."""
    pending = b""
    while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
        pending += chunk
        while (cut := min((j for j in (pending.find(b"\n"), pending.find(b"\r")) if j >= 0),
                          default=-1)) >= 0:  # fmt: skip
            piece, pending = pending[: cut + 1].decode("utf-8", "replace"), pending[cut + 1 :]
            _put(i, piece, out, quiet)
    if pending:
        _put(i, pending.decode("utf-8", "replace"), out, quiet)
    out.put((i, None))


def _put(i: int, piece: str, out: queue.Queue, quiet: bool) -> None:
    if quiet:
        piece = _GLOO_CONNECTED.sub("", piece)
        if _GLOO_LEFTOVER.match(piece):
            return
    out.put((i, piece))


class _Relay:
    """Writes the processes' pieces with a ``[p<i>]`` prefix; a redraw (a piece ending in
    ``\r``) overwrites the previous redraw in place, as the process's own bar would."""

    def __init__(self) -> None:
        self.redrawing = False

    def write(self, i: int, piece: str) -> None:
        if piece.endswith("\r"):
            sys.stdout.write(f"\r[p{i}] {piece[:-1]}")
            self.redrawing = True
        else:
            head = "\n" if self.redrawing else ""
            end = "" if piece.endswith("\n") else "\n"
            sys.stdout.write(f"{head}[p{i}] {piece}{end}")
            self.redrawing = False
        sys.stdout.flush()


def launch(
    processes: int,
    train_args: Sequence[str],
    *,
    devices_per_process: int,
    port: int | None = None,
    grace_s: float = 30.0,
    env: dict[str, str] | None = None,
    commands: Sequence[Sequence[str]] | None = None,
    host: str = "127.0.0.1",
    verbose: bool = False,
) -> int:
    """Run ``processes`` copies of ``python -m train train_args``; their first failing
    exit code, or 0. ``commands`` replaces the command of each process (for tests and for
    wrappers such as ``ip netns exec``); the environment is set the same way. ``host`` is
    the coordinator's address (process 0's host). ``verbose`` keeps gloo's connection
    lines, which are dropped otherwise."""
    return _generation(
        processes,
        train_args,
        devices_per_process=devices_per_process,
        port=port,
        grace_s=grace_s,
        env=env,
        commands=commands,
        host=host,
        verbose=verbose,
    ).rc


class Ended(NamedTuple):
    """How one start of the processes ended: the launcher's exit code, and the first
    process to fail with its raw return code (negative: killed by that signal)."""

    rc: int
    first_fail: tuple[int, int] | None


def _generation(
    processes: int,
    train_args: Sequence[str],
    *,
    devices_per_process: int,
    port: int | None = None,
    grace_s: float = 30.0,
    env: dict[str, str] | None = None,
    commands: Sequence[Sequence[str]] | None = None,
    host: str = "127.0.0.1",
    verbose: bool = False,
) -> Ended:
    """One start of the processes (see :func:`launch`)."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if devices_per_process < 1:
        raise ValueError(f"devices_per_process must be >= 1, got {devices_per_process}")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    if commands is not None and len(commands) != processes:
        raise ValueError(
            f"commands must have one entry per process ({processes}), got {len(commands)}"
        )
    port = free_port() if port is None else port
    base = dict(os.environ if env is None else env)
    # Simulated CPU devices: without this, on a GPU machine every process takes every GPU.
    base.setdefault("JAX_PLATFORMS", "cpu")
    flags = [f for f in base.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
    lines: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    die_with_parent = _death_signal_setter()
    for i in range(processes):
        penv = {
            **base,
            "XLA_FLAGS": " ".join(flags),
            ENV_COORDINATOR: f"{host}:{port}",
            ENV_NUM_PROCESSES: str(processes),
            ENV_PROCESS_ID: str(i),
            "PYTHONUNBUFFERED": "1",
            ENV_LAUNCHED: str(processes),
        }
        cmd = list(commands[i]) if commands else [sys.executable, "-m", __package__, *train_args]
        if i and not commands and "--no-progress" not in cmd:
            cmd.append("--no-progress")  # one progress bar, process 0's
        p = subprocess.Popen(
            cmd,
            env=penv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # bytes: a stray byte is replaced, never fatal
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        procs.append(p)
        print(f"[launch] process {i}: pid {p.pid}", file=sys.stderr, flush=True)
        threading.Thread(target=_pump, args=(i, p.stdout, lines, not verbose), daemon=True).start()

    first_fail: tuple[int, int] | None = None
    open_streams = processes
    relay = _Relay()
    # The last `error: ...` line of each process: the failure it reports as it exits.
    errors: dict[int, str] = {}
    closed: set[int] = set()

    def take(i: int, line: str | None) -> None:
        nonlocal open_streams
        if line is None:
            open_streams -= 1
            closed.add(i)
        else:
            relay.write(i, line)
            if line.startswith(_ERROR):  # the last one: what it ended on
                errors[i] = line[len(_ERROR) :].strip()

    def read_out(i: int, within_s: float = 5.0) -> None:
        """Relay what process ``i`` (which has exited) wrote before it ended: its output
        may still sit in the pipe or the queue when its exit is seen."""
        end = time.monotonic() + within_s
        while i not in closed and time.monotonic() < end:
            try:
                take(*lines.get(timeout=0.05))
            except queue.Empty:
                pass

    class _Stopped(KeyboardInterrupt):
        def __init__(self, signum: int):
            super().__init__(f"signal {signum}")
            self.signum = signum

    def on_signal(signum: int, _frame: object) -> None:
        raise _Stopped(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C stops the run even where the launcher started with SIGINT ignored (a shell's
    # background job): a KeyboardInterrupt, as the trainer's own handler does for a process.
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while open_streams or any(p.poll() is None for p in procs):
            try:
                take(*lines.get(timeout=0.2))
            except queue.Empty:
                pass
            codes = [p.poll() for p in procs]
            # A process killed by a signal first: when one dies, a survivor may fail on its
            # own (a broken collective) within the same poll; the death is what happened.
            for i in sorted(range(len(procs)), key=lambda j: not (codes[j] or 0) < 0):
                rc = codes[i]
                if rc not in (None, 0) and first_fail is None:
                    first_fail = (i, rc)
                    if rc in _SAVED_AND_STOPPED:
                        # Stopped by a signal after a checkpoint: the others saved the same
                        # step with it and are ending too; give them the grace to finish.
                        print(
                            f"[launch] process {i} stopped after a checkpoint (exit code {rc}); "
                            "waiting for the others",
                            file=sys.stderr,
                            flush=True,
                        )
                        _stop_after(procs, grace_s)
                        continue
                    read_out(i)
                    said = f": {errors[i]}" if i in errors else ""
                    print(
                        f"[launch] process {i} failed ({_how(rc)}){said}; stopping the other "
                        "processes",
                        file=sys.stderr,
                        flush=True,
                    )
                    _stop(procs, 0.0)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(
            f"[launch] {signal.Signals(signum).name}: every process saves a checkpoint and "
            f"stops (at most {grace_s:g} s; Ctrl-C again stops them at once)",
            file=sys.stderr,
            flush=True,
        )
        _signal(procs, signal.SIGTERM)
        end = time.monotonic() + grace_s
        try:
            while time.monotonic() < end and (open_streams or any(p.poll() is None for p in procs)):
                try:
                    take(*lines.get(timeout=0.2))
                except queue.Empty:
                    continue
        except KeyboardInterrupt:
            print(
                "\n[launch] stopped at once; the newest complete checkpoint is kept",
                file=sys.stderr,
                flush=True,
            )
        return Ended(128 + signum, first_fail)  # 130 for Ctrl-C, 143 for SIGTERM
    finally:
        _stop(procs, 0.0)  # whatever ended the loop, no process outlives the launcher
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if first_fail is not None:
        return Ended(_exit_code(first_fail[1]), first_fail)
    return Ended(0, None)


def _how(rc: int) -> str:
    """How a process ended, from its raw return code."""
    if rc == STOPPED_AT_ONCE:
        return f"stopped at once by a second Ctrl-C: exit code {rc}"
    return f"signal {-rc}" if rc < 0 else f"exit code {rc}"


# How `python -m train` reports a failure before it exits non-zero (at once, in a
# multi-process run: it does not wait for the others in JAX's shutdown).
_ERROR = "error: "


def _signal(procs: list[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to every running process's group."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass  # it ended meanwhile


# Exit codes of `python -m train` stopped by SIGINT / SIGTERM once it saved a checkpoint.
_SAVED_AND_STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def _stop_after(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for every process to end on its own, then stop the rest."""
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            break
    _stop(procs, 0.0)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every running process's group, SIGKILL what is left after ``grace_s``."""
    _signal(procs, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal([p], signal.SIGKILL)
            p.wait()


def smaller_world(cfg: Any, survivors: int, min_processes: int, devices_per_process: int):
    """``(processes, workers)`` of the largest world of at most ``survivors`` processes (and
    at least ``min_processes``) that runs ``cfg`` with each process keeping its
    ``devices_per_process`` devices: ``workers = processes * devices_per_process / stages``
    data replicas, a divisor of the global batch (with a pipeline's microbatches). None
    when there is none."""
    for p in range(survivors, min_processes - 1, -1):
        devices = p * devices_per_process
        if p < 1 or devices % cfg.stages:
            continue
        try:
            cfg.replace(workers=devices // cfg.stages)
        except ValueError:
            continue  # the global batch does not split over that many workers
        return p, devices // cfg.stages
    return None


def _newest_checkpoint(run_dir: Path) -> int | None:
    folder = run_dir / "checkpoints"
    steps = [int(q.name) for q in folder.iterdir() if q.name.isdigit()] if folder.is_dir() else []
    return max(steps, default=None)


def elastic(
    processes: int,
    train_args: Sequence[str],
    cfg: Any,
    *,
    devices_per_process: int,
    min_processes: int,
    max_restarts: int,
    port: int | None = None,
    grace_s: float = 30.0,
    verbose: bool = False,
    env: dict[str, str] | None = None,
    compile_cache: str | os.PathLike | None = None,
) -> int:
    """Run ``python -m train train_args`` as ``processes`` processes and keep it running
    when processes are lost: when a process dies by a signal (``kill -9``, a lost machine),
    the others are stopped and the run restarts from its newest checkpoint on the largest
    world the survivors can form (:func:`smaller_world`, at least ``min_processes``), its
    per-worker state resized (:func:`jaxcomm.elastic.resize_workers`), at most ``max_restarts``
    times. A process that fails with an exit code (an error in the run, a non-finite loss)
    ends the run as :func:`launch` does: restarting would fail the same way. With
    ``compile_cache`` (a folder), the processes keep every compiled program there (JAX's
    persistent compilation cache), so a restart on a world size seen before skips its
    compilation. Returns the exit code of the last start."""
    live, restarts, args = processes, 0, list(train_args)
    base = dict(os.environ if env is None else env)
    if compile_cache is not None:
        # Every program compiled is kept on disk: a restart on a world size seen before
        # loads its programs instead of compiling them again. JAX's defaults skip programs
        # that compile in under a second, most of a small run's.
        base.setdefault("JAX_COMPILATION_CACHE_DIR", str(compile_cache))
        base.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        base.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    while True:
        ended = _generation(
            live,
            args,
            devices_per_process=devices_per_process,
            port=port,
            grace_s=grace_s,
            env=base,
            verbose=verbose,
        )
        failed = ended.first_fail
        if failed is None or failed[1] >= 0 or -failed[1] in (signal.SIGINT, signal.SIGTERM):
            return ended.rc
        lost, sig = failed[0], signal.Signals(-failed[1]).name
        if restarts >= max_restarts:
            print(
                f"[launch] process {lost} lost ({sig}); --max-restarts={max_restarts} reached: "
                f"stopping (continue with {_resume_hint(cfg, live)})",
                file=sys.stderr,
                flush=True,
            )
            return ended.rc
        plan = smaller_world(cfg, live - 1, min_processes, devices_per_process)
        if plan is None:
            print(
                f"[launch] process {lost} lost ({sig}); the {live - 1} survivors cannot form a "
                f"world of at least --min-processes={min_processes} that divides the global "
                f"batch {cfg.global_batch}: stopping (continue with {_resume_hint(cfg, live)})",
                file=sys.stderr,
                flush=True,
            )
            return ended.rc
        restarts += 1
        live, workers = plan
        step = _newest_checkpoint(cfg.run_dir)
        args = [a for a in train_args if a != "--resume"] + ["--set", f"workers={workers}"]
        if step is not None:
            args.append("--resume")
        start = "the start (no checkpoint yet)" if step is None else f"checkpoint step {step}"
        print(
            f"[launch] process {lost} lost ({sig}); restart {restarts} of at most "
            f"{max_restarts}: {live} processes, {workers} workers, from {start}",
            file=sys.stderr,
            flush=True,
        )


def parser() -> argparse.ArgumentParser:
    """The launcher's own options (the rest pass through to ``python -m train``)."""
    p = argparse.ArgumentParser(
        prog=f"{RUN}.launch",
        usage=f"{RUN}.launch --processes P [--min-processes M] [--max-restarts R] "
        f"[--port N] [--grace S] [--verbose] [{RUN}'s arguments]",
        description=f"Run {RUN} as several processes on this machine. Every "
        f"argument not listed below passes through to each process's {RUN} "
        f"(--config, --set, --resume, --no-progress; see {RUN} --help).",
        epilog=f"example: {RUN}.launch --processes 2 --config configs/dp_default.yaml "
        "--set steps=50",
    )
    p.add_argument("--processes", type=int, required=True, help="processes to start (>= 1)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the processes get to save a checkpoint after Ctrl-C before they are killed",
    )
    p.add_argument("--verbose", action="store_true", help="keep gloo's per-connection lines")
    p.add_argument(
        "--min-processes",
        type=int,
        default=None,
        help="elastic: when a process is lost, restart the survivors (at least this many) "
        "from the newest checkpoint on fewer workers (default: no restart)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="elastic: restarts after lost processes before giving up (default 3)",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        help="elastic: keep compiled programs in this folder for restarts (default: "
        "<run folder>/compile_cache; 'off': none)",
    )
    return p


def _resume_hint(cfg: Any, processes: int) -> str:
    """The launcher command that continues ``cfg``'s run on ``processes`` processes."""
    from .config import resume_command

    return resume_command(cfg.run_dir, f"{RUN}.launch --processes {processes}")


def _resume_folder_as_out_dir(train_args: list[str], folder: str) -> list[str]:
    """``train_args`` with ``--resume DIR`` (or ``--resume=DIR``) written as ``--resume --set
    out_dir=DIR`` (what it means), so a restart can drop and add ``--resume`` alone."""
    from .config import out_dir_override

    out: list[str] = []
    skip = False
    for i, a in enumerate(train_args):
        if skip:
            skip = False
        elif a == "--resume" and i + 1 < len(train_args) and train_args[i + 1] == folder:
            out += ["--resume", "--set", out_dir_override(folder)]
            skip = True
        elif a == f"--resume={folder}":
            out += ["--resume", "--set", out_dir_override(folder)]
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse ``--processes`` (and ``--port``, ``--grace``), check the config, launch."""
    p = parser()
    args, train_args = p.parse_known_args(argv)
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    if args.port is not None and not 1 <= args.port <= 65535:
        p.error(f"--port must be in [1, 65535], got {args.port}")
    if args.grace < 0:
        p.error(f"--grace must be >= 0, got {args.grace}")
    targs = train_parser().parse_args(train_args)
    if isinstance(targs.resume, str):  # every process, and every restart, resumes that folder
        train_args = _resume_folder_as_out_dir(train_args, targs.resume)
    try:
        cfg = config_from_args(targs)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = cfg.workers * cfg.stages
    if devices % args.processes:
        print(
            f"error: --processes={args.processes} must divide the mesh's workers x stages = "
            f"{cfg.workers} x {cfg.stages} = {devices} devices",
            file=sys.stderr,
        )
        return 2
    if args.min_processes is None:
        elastic_only = {"--max-restarts": args.max_restarts, "--compile-cache": args.compile_cache}
        given = [flag for flag, value in elastic_only.items() if value is not None]
        if given:
            p.error(f"{given[0]} applies to an elastic run: give --min-processes too")
    else:
        args.max_restarts = 3 if args.max_restarts is None else args.max_restarts
        if not 1 <= args.min_processes <= args.processes:
            p.error(
                f"--min-processes must be in [1, --processes={args.processes}], got "
                f"{args.min_processes}"
            )
        if args.max_restarts < 0:
            p.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
        return elastic(
            args.processes,
            train_args,
            cfg,
            devices_per_process=devices // args.processes,
            min_processes=args.min_processes,
            max_restarts=args.max_restarts,
            port=args.port,
            grace_s=args.grace,
            verbose=args.verbose,
            compile_cache=None
            if args.compile_cache == "off"
            else (args.compile_cache or cfg.run_dir / "compile_cache"),
        )
    return launch(
        args.processes,
        train_args,
        devices_per_process=devices // args.processes,
        port=args.port,
        grace_s=args.grace,
        verbose=args.verbose,
    )


if __name__ == "__main__":
    sys.exit(main())
