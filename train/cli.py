"""Command line: ``python -m train --config configs/dp_default.yaml [--set key=value ...]``."""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import sys
from pathlib import Path
from typing import Any

from . import CONFIGS_DIR, RUN

# The most simulated CPU devices one process runs (a mesh of 4,096 fails inside XLA; 1,024
# compile and run).
MAX_SIMULATED = 1024


def shipped_configs() -> list[tuple[str, str]]:
    """``(path, first line of its comment)`` of every shipped config."""
    folder = CONFIGS_DIR
    out = []
    for path in sorted(folder.glob("*.yaml")):
        comment = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            comment.append(line.lstrip("#").strip())
        text = " ".join(comment)
        first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
        if len(first) > 80:
            first = first[:77].rsplit(" ", 1)[0] + "..."
        out.append((f"configs/{path.name}", first))
    return out


def resolve_config(path: str | None) -> str | None:
    """``path`` as given when it exists; else a shipped config of that name
    (``configs/dp_default.yaml`` from any folder); else as given (its error names it)."""
    if path is None or Path(path).exists():
        return path
    shipped = CONFIGS_DIR / Path(path).name
    return str(shipped) if shipped.is_file() else path


def _epilog() -> str:
    from .aggregators import AGGREGATORS
    from .config import COMPRESS_PRESETS, SYNCS

    lines = ["shipped configs (--config PATH):"]
    for path, what in shipped_configs():
        lines.append(f"  {path:<30} {what}")
    lines += [
        "",
        f"aggregators (--set aggregator=...): {', '.join(AGGREGATORS.names())}",
        f"sync methods (--set sync.method=..., with aggregator=none): {', '.join(SYNCS.names())}",
        f"  diloco compress: none, {', '.join(COMPRESS_PRESETS)} or any aggregator",
        "network (--set network=...): LATENCY,BANDWIDTH such as 1ms,1Gbps or 50ms,100Mbps; a",
        "  schedule STEP:LATENCY,BANDWIDTH;... such as '0:1ms,10Gbps;100:50ms,1Gbps'; or c1, c2:",
        "  the AR-Topk paper's two changing networks (1-50 ms, 1-25 Gbps over the run;",
        "  jaxcomm.network.NetworkSchedule.preset)",
        "",
        f"every config key with its default and meaning: {RUN} --list-keys",
        "a second run beside the first: --set name=NEW (writes runs/NEW) or --set out_dir=DIR",
        f"several processes on this machine: {RUN}.launch --processes P [these args]",
    ]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m train``."""
    p = argparse.ArgumentParser(
        prog=RUN,
        description=plain(__doc__),
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML experiment config (default: built-in defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set steps=50 --set model.width=64 (repeatable)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="DIR",
        help="continue a run from its newest checkpoint: the run folder DIR (or the one --set "
        "name=/out_dir= names, or --config's); without --config its saved config.json is "
        "used, with --set applied on top (e.g. --set steps=600 to go further)",
    )
    p.add_argument(
        "--allow-unverified",
        action="store_true",
        help="with --resume: also resume a checkpoint that cannot be verified (no checksum "
        "file, or written before run identities); a damaged or foreign one is never used",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar: a plain line every 30 seconds instead",
    )
    p.add_argument(
        "--list-keys", action="store_true", help="print every config key, its default and meaning"
    )
    p.add_argument(
        "--standby",
        metavar="FILE",
        help="a hot spare: load the libraries, then wait for FILE to name this process's "
        "arguments, log and cores (written by python -m train.groups --spare)",
    )
    return p


def standby(path: Path, poll_s: float = 0.05) -> int:
    """Wait as a hot spare that forks each restarted group: with JAX, torch, torchft and
    the trainer imported (the seconds a cold start spends before its first step; no JAX
    backend is initialised, so a fork is safe and the device count is still free), write
    ``<path>.ready``, then serve orders. An order is ``path`` holding a JSON object
    ``{"id": K, "argv": [...], "log": FILE, "cpus": [...] or null}``: the spare takes it
    (removes ``path``), forks a child whose output goes to ``log``, whose cores are
    ``cpus`` and which runs ``main(argv)``, and writes the child's pid to ``<path>.K.pid``
    and, once the child ends, its exit code (``-N`` for signal ``N``, as
    :class:`subprocess.Popen` reports it) to ``<path>.K.rc``. One spare serves every
    restart of a run, each a fork of the same loaded interpreter. It ends when its
    launcher does (once its children have ended), or with 2 on a malformed order."""
    import json
    import time

    import torchft  # noqa: F401  (the import the spare is kept for)

    from . import replica_groups, trainer  # noqa: F401

    path = Path(path)
    parent = os.getppid()
    children: dict[int, Path] = {}  # pid -> where its exit code goes
    Path(f"{path}.ready").write_text(str(os.getpid()))
    while True:
        for pid, rc in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                tmp = rc.with_suffix(".tmp")
                tmp.write_text(str(os.waitstatus_to_exitcode(status)))
                tmp.replace(rc)
                del children[pid]
        if os.getppid() != parent and not children:  # the launcher is gone
            return 1
        if not path.is_file():
            time.sleep(poll_s)
            continue
        try:
            order = json.loads(path.read_text())
            key, argv, log, cpus = order["id"], order["argv"], order["log"], order.get("cpus")
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise TypeError(f"argv must be a list of strings, got {argv!r}")
            if not isinstance(key, int):
                raise TypeError(f"id must be an integer, got {key!r}")
        except (ValueError, KeyError, TypeError) as e:
            print(f"error: --standby {path}: not an order ({e})", file=sys.stderr)
            return 2
        path.unlink()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _forked(argv, log, cpus)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)  # never back into the spare's loop
        children[pid] = Path(f"{path}.{key}.rc")
        tmp = Path(f"{path}.{key}.tmp")
        tmp.write_text(str(pid))
        tmp.replace(Path(f"{path}.{key}.pid"))


def _forked(argv: list[str], log: str, cpus: list[int] | None) -> int:
    """A spare's child: its output to ``log``, on the cores ``cpus``, back to the normal
    scheduling class (a spare loads at SCHED_IDLE), then ``main(argv)``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if cpus is not None:
        os.sched_setaffinity(0, set(cpus))
    # A fork has one thread; those it starts from here on inherit its class.
    if hasattr(os, "SCHED_OTHER") and os.sched_getscheduler(0) != os.SCHED_OTHER:
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            print("warning: the spare could not leave the idle scheduling class (no "
                  "permission)", file=sys.stderr)  # fmt: skip
    return main(list(argv))


def list_keys() -> str:
    """Every config key, its default and its meaning, as the CLI prints it."""
    import textwrap

    from .config import key_docs

    out = []
    for key, default, text in key_docs():
        out.append(f"{key} ({format_default(default)})")
        out += textwrap.wrap(plain(text), width=92, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out)


def format_default(value: Any, quote: str = "") -> str:
    """A config key's default as the reference shows it (``...``: required)."""
    return "required" if value is ... else f"default: {quote}{value!r}{quote}"


def plain(text: str) -> str:
    """Docstring markup as a terminal shows it: ````x```` and ``:func:`x``` become ``x``."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def config_from_args(args: argparse.Namespace) -> Any:
    """The run's :class:`~train.config.Config` from parsed arguments. ``--resume DIR`` means
    ``--set out_dir=DIR --resume``; resuming without ``--config`` starts from the run
    folder's saved ``config.json`` (then ``--set`` on top), so a run continues with the
    settings it was started with. Normalises ``args.resume`` to a bool and
    ``args.overrides`` to the full list."""
    from .config import config_from_dict, load_config, out_dir_override, read_saved_config

    if isinstance(args.resume, str):
        args.overrides = [out_dir_override(args.resume), *args.overrides]
        args.resume = True
    args.config = resolve_config(args.config)
    if args.resume and args.config is None:
        where = [o for o in args.overrides if o.split("=", 1)[0].strip() in ("name", "out_dir")]
        run_dir = load_config(None, where).run_dir
        saved = run_dir / "config.json"
        if not saved.is_file() and (run_dir / "checkpoints").is_dir():
            raise ValueError(
                f"{str(run_dir)!r} holds checkpoints but no config.json: give the run's "
                "settings with --config (and --set)"
            )
        if saved.is_file():
            data = read_saved_config(saved)
            data["progress"] = True  # the bar is this invocation's choice (--no-progress)
            # The folder found is the one resumed (a copied folder's config names another).
            data["out_dir"] = str(run_dir)
            return config_from_dict(data, args.overrides)
    return load_config(args.config, args.overrides)


def _failed(message: str, code: int = 1) -> int:
    """Report a failed run in one line and return its exit code. One process of several
    exits at once: the others wait for it in a collective, and it would wait for them in
    JAX's shutdown, so the launcher would see whichever gave up first instead of it."""
    print(f"error: {message}", file=sys.stderr)
    from . import distributed

    if distributed.requested():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run one training job, print its summary."""
    args = parser().parse_args(argv)
    if args.standby is not None:
        return standby(Path(args.standby))
    if args.list_keys:
        try:
            print(list_keys())
        except BrokenPipeError:  # e.g. piped into head
            sys.stderr.close()
        return 0
    if args.no_progress:
        args.overrides = [*args.overrides, "progress=false"]
    try:
        cfg = config_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.allow_unverified and not args.resume:
        print("error: --allow-unverified applies to --resume", file=sys.stderr)
        return 2
    if args.resume:
        from .trainer import nothing_to_resume

        why = nothing_to_resume(cfg)
        if why is not None:
            return _failed(why)
    from . import distributed

    if distributed.requested():
        # One of several processes (train.launch or a cluster's launcher): it owns the
        # devices its environment gives it, and the mesh spans every process's devices.
        # Where JAX's coordination service ends a process (a peer lost, a barrier timed
        # out), it aborts: print every thread's Python stack then, to say where it was.
        faulthandler.enable()
        try:
            distributed.initialize()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        # Simulated CPU devices must be requested before JAX initialises its backends.
        if cfg.workers * cfg.stages > MAX_SIMULATED:
            print(
                f"error: workers x stages = {cfg.workers} x {cfg.stages} simulated CPU devices; "
                f"one process simulates at most {MAX_SIMULATED} (XLA fails beyond): use fewer, "
                f"or several processes ({RUN}.launch) or hosts",
                file=sys.stderr,
            )
            return 2
        flag = f"--xla_force_host_platform_device_count={cfg.workers * cfg.stages}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    from .trainer import Interrupted, RunFolderBusy, Trainer

    try:
        summary = Trainer(cfg).run(resume=args.resume, allow_unverified=args.allow_unverified)
    except KeyboardInterrupt:  # before the run's handlers, or a second Ctrl-C
        print("interrupted; nothing was saved beyond the newest checkpoint", file=sys.stderr)
        if distributed.requested():
            # The other processes will not reach JAX's shutdown barrier with this one: end
            # now, without it, under a code the launcher reads as "stop the rest at once".
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(distributed.STOPPED_AT_ONCE)
        return 130
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return 128 + e.signum
    except (ValueError, FloatingPointError, FileNotFoundError, RunFolderBusy, ConnectionError) as e:
        return _failed(str(e))
    except OSError as e:  # a read-only or full disk, a folder that vanished
        return _failed(f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else ""))
    if distributed.is_primary():
        from .summary import format_summary

        print("\n" + format_summary(summary))
        print(f"metrics, plot and checkpoints in {cfg.run_dir}/")
    return 0
