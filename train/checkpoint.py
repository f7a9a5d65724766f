"""A run's state on disk: what a trainer saves and restores, the run-folder lock, Orbax
checkpoints with SHA-256 sums and a fallback to the newest intact one, and the exported
model parameters.

:class:`Checkpoints` saves whatever state tree a trainer gives it, with a fingerprint of the
run (what a checkpoint must match to be resumed) and host-side extras as JSON; restoring
checks the files against the sums written at the commit, moves damaged newer checkpoints
aside, and refuses a checkpoint of a different run, naming what differs. Step sizes
(an aggregator's ``step_sizes``) may change on resume.

A state array whose leading (worker) axis holds the same bits in every row (parameters and
optimizer state under synchronous training, the synchronised model of local SGD just after
an average) is saved once, as its first row; arrays that differ per worker (error feedback,
local SGD replicas between averages) are saved whole. Which arrays were saved once is part
of the checkpoint, and restoring broadcasts them back to every worker bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization
from jax.sharding import NamedSharding, PartitionSpec

from .distributed import is_primary, to_host
from .programs import AXIS

if TYPE_CHECKING:
    from .context import Context

__all__ = [
    "Checkpoints",
    "RunFolderBusy",
    "run_lock",
    "lock_holder",
    "write_checksums",
    "write_atomically",
    "verify_checksums",
    "save_model_params",
    "load_model_params",
    "resume_note",
    "run_fingerprint",
    "save_run",
    "restore_run",
]

# The file of a run folder naming the run that owns it: every checkpoint stores the same id.
RUN_FILE = "run.json"


def _changed_step_sizes(old: Any, new: Any, sizes: Any) -> dict[str, tuple[Any, Any]] | None:
    """``{key: (old, new)}`` of the step sizes (the keys ``sizes``) that differ when
    ``old`` and ``new`` aggregator arguments differ in step sizes only; None when anything
    else differs (or nothing does)."""
    if not isinstance(old, dict) or not isinstance(new, dict) or old == new:
        return None
    sizes = tuple(sizes or ())
    rest = lambda d: {k: v for k, v in d.items() if k not in sizes}  # noqa: E731
    if rest(old) != rest(new):
        return None
    return {k: (old.get(k), new.get(k)) for k in sizes if old.get(k) != new.get(k)}


def _sha256(path: Any) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checkpoint_files(run_dir: Any, step: int) -> dict[str, Any]:
    """Every file of checkpoint ``step``: its Orbax folder and the message-buffer snapshots
    saved with it (a pipeline's ``buffers/<step>``), by path relative to ``run_dir``."""
    files = {}
    for root in (run_dir / "checkpoints" / str(step), run_dir / "buffers" / str(step)):
        for p in sorted(root.rglob("*")):
            if p.is_file():
                files[str(p.relative_to(run_dir))] = p
    return files


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (text or bytes): a temporary file beside it, renamed
    (a crash leaves the old file or the new, never half of one; a failed write, e.g. a full
    disk, removes the temporary file and raises)."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp"
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_checksums(run_dir: Any, step: int, kept: Any = ()) -> None:
    """Write the SHA-256 of every file of checkpoint ``step`` to ``run_dir/checksums/
    <step>.json`` (atomically), and drop the sums of checkpoints no longer kept."""
    folder = run_dir / "checksums"
    folder.mkdir(exist_ok=True)
    sums = {name: _sha256(p) for name, p in _checkpoint_files(run_dir, step).items()}
    write_atomically(folder / f"{step}.json", json.dumps(sums, indent=0, sort_keys=True))
    keep = {f"{s}.json" for s in kept} | {f"{step}.json"}
    for old in folder.glob("*.json"):
        if old.name not in keep:
            old.unlink(missing_ok=True)


class Unverified(str):
    """A reason a checkpoint cannot be verified (as opposed to found damaged): it has no
    checksum file, or it predates the run identity. Resumed only when asked
    (``allow_unverified``)."""


def verify_checksums(run_dir: Any, step: int) -> str | None:
    """None when checkpoint ``step``'s files are exactly the files its checksum file lists,
    each with the SHA-256 written at its commit; otherwise what is wrong, naming the first
    bad file. The reason is an :class:`Unverified` when there is no checksum file at all
    (its writer stopped between the commit and the sums)."""
    path = run_dir / "checksums" / f"{step}.json"
    try:
        sums = json.loads(path.read_text())
    except FileNotFoundError:
        return Unverified(f"it has no checksum file {path}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"its checksum file {path} is unreadable"
    if not isinstance(sums, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in sums.items()
    ):
        return f"its checksum file {path} does not hold a file -> SHA-256 mapping"
    files = _checkpoint_files(run_dir, step)
    if not files:
        return "it holds no files"
    for name, digest in sorted(sums.items()):
        if name not in files:
            return f"file {name} is missing"
        if _sha256(files[name]) != digest:
            return f"file {name} differs from what was written"
    extra = sorted(set(files) - set(sums))
    if extra:
        return f"file {extra[0]} is not among the files its checksum file lists"
    return None


def read_run_id(run_dir: Any) -> str | None:
    """The identity of the run that owns ``run_dir`` (``run.json``), or None."""
    try:
        found = json.loads((Path(run_dir) / RUN_FILE).read_text()).get("run_id")
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return found if isinstance(found, str) and found else None


def _identity_problem(
    run_dir: Any, step: int, run_id: str | None, mine: dict | None = None
) -> str | None:
    """None when checkpoint ``step`` proves it belongs to run ``run_id`` and to step
    ``step`` (both are stored in its ``meta`` item at the save); else why not (an
    :class:`Unverified` when it or the folder predates run identities). ``mine``, this
    run's fingerprint, names the settings a foreign checkpoint's run differs in."""
    path = Path(run_dir) / "checkpoints" / str(step) / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return f"its run description {path} is missing or unreadable"
    if not isinstance(meta, dict):
        return f"its run description {path} is not a mapping"
    if "run_id" not in meta or "step" not in meta:
        return Unverified("it was written without a run identity (an older format)")
    if meta["step"] != step:
        return f"its folder is named {step} but it holds step {meta['step']!r}"
    if run_id is None:
        return Unverified(f"the run folder has no {RUN_FILE} to match it against")
    if meta["run_id"] != run_id:
        return (
            f"it belongs to another run (run id {meta['run_id']!r}; this folder's run is "
            f"{run_id!r}){_setting_differences(meta, mine)}"
        )
    return None


def _reason(step: int, problem: str) -> str:
    """``step N (problem)``, an :class:`Unverified` when the problem is one."""
    text = f"step {step} ({problem})"
    return Unverified(text) if isinstance(problem, Unverified) else text


def _setting_differences(meta: dict, mine: dict | None) -> str:
    """The settings in which a foreign checkpoint's run differs from this one, for the
    refusal's message ("" when none is known)."""
    diff = [
        f"{k}: checkpoint {meta[k]!r} vs config {v!r}"
        for k, v in (mine or {}).items()
        if k != "param_shapes" and k in meta and meta[k] != v
    ]
    return "; " + "; ".join(diff) if diff else ""


class RunFolderBusy(RuntimeError):
    """Another live run holds the run folder's lock."""


def lock_holder(run_dir: Any) -> str | None:
    """Who holds ``run_dir``'s lock (``pid on host``, as :func:`run_lock` writes it) while a
    live run holds it; None when nobody does. Creates nothing."""
    import fcntl

    path = Path(run_dir) / ".lock"
    try:
        f = open(path)
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return f.read().strip() or "unknown"
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


@contextlib.contextmanager
def run_lock(run_dir: Any):
    """Hold an exclusive lock on ``run_dir/.lock`` (released when the process ends, however
    it ends); raise ``RuntimeError`` naming the holder when another run has it."""
    import fcntl

    path = run_dir / ".lock"
    with open(path, "a+") as f:
        for attempt in range(3):  # lock_holder's probe holds a shared lock for an instant
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if attempt < 2:
                    time.sleep(0.05)
        else:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise RunFolderBusy(
                f"another run is writing to {str(run_dir)!r} (process {holder}); wait for it, "
                "or give this run another folder (--set name=... or --set out_dir=...)"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} on {socket.gethostname()}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def save_model_params(path: str | os.PathLike, params: Any) -> None:
    """Write a parameter tree to ``path`` as msgpack, atomically (temporary file, rename)."""
    data = serialization.msgpack_serialize(
        serialization.to_state_dict(jax.tree_util.tree_map(np.asarray, params))
    )
    write_atomically(path, data)


def load_model_params(path: str | os.PathLike, template: Any) -> Any:
    """Read parameters written by :func:`save_model_params` into ``template``'s structure.

    Raises ``ValueError`` naming the first leaf whose path, shape or dtype differs.
    """
    with open(path, "rb") as f:
        state = serialization.msgpack_restore(f.read())
    want = jax.tree_util.tree_flatten_with_path(serialization.to_state_dict(template))[0]
    got = dict(jax.tree_util.tree_flatten_with_path(state)[0])
    for key, leaf in want:
        name = jax.tree_util.keystr(key)
        if key not in got:
            raise ValueError(f"init_params {os.fspath(path)!r} has no parameter {name}")
        have = np.asarray(got.pop(key))
        if have.shape != np.shape(leaf) or have.dtype != np.asarray(leaf).dtype:
            raise ValueError(
                f"init_params {os.fspath(path)!r}: parameter {name} is {have.dtype}"
                f"{list(have.shape)}, the model needs {np.asarray(leaf).dtype}"
                f"{list(np.shape(leaf))}"
            )
    if got:
        extra = jax.tree_util.keystr(next(iter(got)))
        raise ValueError(
            f"init_params {os.fspath(path)!r} has a parameter the model lacks: {extra}"
        )
    return serialization.from_state_dict(template, state)


def resume_note(folder: Path | None, step: int | None) -> str:
    """Where a stopped run can continue from (checkpoint ``step`` in ``folder``; None: none
    was written), for its error message."""
    if step is None or folder is None:
        return "no checkpoint was written yet: start again (e.g. with a smaller lr)"
    from .config import resume_command

    return (
        f"the newest checkpoint, step {step} ({folder / str(step)}), is intact: continue it "
        f"with {resume_command(folder.parent)} (step sizes such as lr may be changed with "
        "--set)"
    )


def has_rows(a: Any) -> bool:
    """Whether state array ``a`` (or its shape) holds one row per worker: a leading axis
    sharded over the workers' mesh axis (state every worker holds bit for bit is one copy,
    with no such axis)."""
    sharding = getattr(a, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not sharding.spec or len(a.shape) < 1:
        return False
    first = sharding.spec[0]
    return AXIS == first or (isinstance(first, tuple) and AXIS in first)


def _row_sharding(a: jax.Array) -> NamedSharding | None:
    """The sharding of one row of ``a`` (its leading axis dropped); None when ``a`` is not
    one row per worker of several workers (nothing to save once)."""
    if not isinstance(a, jax.Array) or not has_rows(a) or a.shape[0] < 2:
        return None
    if not _comparable(a.dtype):
        return None  # saved whole: typed PRNG keys, complex, sub-byte integers
    spec = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
    return NamedSharding(a.sharding.mesh, PartitionSpec(*spec[1:]))


def _comparable(dtype: Any) -> bool:
    """Whether rows of ``dtype`` can be compared bit for bit by :func:`_bits` (bool, and
    integers and floats of 8, 16, 32 or 64 bits)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    if dtype == jnp.bool_:
        return True
    if jnp.issubdtype(dtype, jnp.integer):
        bits = jnp.iinfo(dtype).bits
    elif jnp.issubdtype(dtype, jnp.floating):
        bits = jnp.finfo(dtype).bits
    else:
        return False
    return bits in (8, 16, 32, 64) and bits == 8 * np.dtype(dtype).itemsize


def _bits(x: jax.Array) -> jax.Array:
    """``x`` as unsigned integers of its width (equal bits compare equal, NaN included)."""
    if x.dtype == jnp.bool_:
        return x
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width)


@jax.jit
def _rows_equal(leaves: list[jax.Array]) -> list[jax.Array]:
    """Per array, whether every row (leading axis) holds the same bits. Reductions over
    the leading axis, not slices of it (it is sharded over workers); one program for the
    whole state, since several programs with collectives in flight at once can starve the
    CPU backend's threads."""
    out = []
    for x in leaves:
        bits = _bits(x)
        out.append(jnp.all(bits.max(0) == bits.min(0)))
    return out


@jax.jit
def _first_rows(leaves: list[jax.Array]) -> list[jax.Array]:
    """Row 0 of each array whose rows are equal: their bitwise maximum over the leading
    axis (a reduction, so no device needs another's row), one program for all of them."""
    rows = []
    for x in leaves:
        top = _bits(x).max(0)
        rows.append(top if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(top, x.dtype))
    return rows


def collapse_rows(state: Any) -> tuple[Any, list[str]]:
    """``(saved, once)``: ``state`` with every array whose rows (leading axis) are bitwise
    identical replaced by its first row, and the key paths of those arrays."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    candidates = [i for i, (_, a) in enumerate(flat) if _row_sharding(a) is not None]
    leaves = [a for _, a in flat]
    once: list[str] = []
    if not candidates:
        return state, once
    equal = to_host(_rows_equal([leaves[i] for i in candidates]))
    # Only the equal arrays' rows are formed: a row of every array would hold a second
    # (replicated) copy of the whole per-worker state on every device while saving.
    same = [i for i, eq in zip(candidates, equal, strict=True) if bool(eq)]
    if not same:
        return state, once
    for i, row in zip(same, _first_rows([leaves[i] for i in same]), strict=True):
        leaves[i] = jax.device_put(row, _row_sharding(leaves[i]))
        once.append(jax.tree_util.keystr(flat[i][0]))
    return jax.tree_util.tree_unflatten(treedef, leaves), once


def _row_targets(template: Any, once: list[str]) -> Any:
    """Restore targets for ``template``: one row's shape and sharding for the arrays in
    ``once``, the whole array's for the rest."""
    names = set(once)

    def target(path, a):
        struct = ocp.utils.to_shape_dtype_struct(a)
        if jax.tree_util.keystr(path) in names and has_rows(a):
            return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=_row_sharding(a))
        return struct  # (an earlier checkpoint's row of what is now one copy: as saved)

    return jax.tree_util.tree_map_with_path(target, template)


def expand_rows(restored: Any, template: Any, once: list[str]) -> Any:
    """Undo :func:`collapse_rows`: each array in ``once`` broadcast back to every row, in
    ``template``'s shape and sharding (one program for all of them)."""
    names = set(once)
    flat, treedef = jax.tree_util.tree_flatten_with_path(restored)
    want = jax.tree_util.tree_leaves(template)
    pick = [
        i
        for i, (path, _) in enumerate(flat)
        if jax.tree_util.keystr(path) in names and has_rows(want[i])
    ]
    if not pick:
        return restored
    shapes = [want[i].shape for i in pick]
    spread = jax.jit(
        lambda rows: [jnp.broadcast_to(r[None], s) for r, s in zip(rows, shapes, strict=True)],
        out_shardings=[want[i].sharding for i in pick],
    )([flat[i][1] for i in pick])
    leaves = [a for _, a in flat]
    for i, a in zip(pick, spread, strict=True):
        leaves[i] = a
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _key_name(key: Any) -> str:
    """A key-path entry as the name Orbax stores it under (dict key, field, index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_names(path: Any) -> tuple[str, ...]:
    return tuple(_key_name(k) for k in path)


@contextlib.contextmanager
def _whole_replicas() -> Any:
    """Orbax's array handler with replica-parallel writing off while a checkpoint is saved,
    its own setting put back after. On a CPU backend Orbax cuts an array held whole on
    several devices into one slice per device, each by an eagerly compiled slice op (seconds
    a checkpoint of the README's model); off, each shard is written from its first replica,
    as Orbax does by default where ``JAX_PLATFORMS`` names a GPU. What is written is the
    same arrays either way. (Saves here are synchronous, on the main thread; an Orbax
    without the setting keeps its default.)"""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    before = getattr(handler, "_use_replica_parallel", None)
    if before is None:
        yield
        return
    handler._use_replica_parallel = False
    try:
        yield
    finally:
        handler._use_replica_parallel = before


class Checkpoints:
    """The checkpoints of one run folder (``<run>/checkpoints/<step>``, Orbax, synchronous).

    Each checkpoint holds a state tree (any pytree of arrays), the run's fingerprint (JSON)
    and host-side extras (JSON). ``saved_step`` is the newest step written or restored by
    this object (None before either)."""

    def __init__(self, run_dir: Path, keep: int):
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False
        )
        self.manager = ocp.CheckpointManager(self.folder.absolute(), options=options)
        self.saved_step: int | None = None

    def start_run(self) -> str:
        """Give the run folder a new identity (``run.json``, on process 0): a run started
        from scratch. Every checkpoint saved after it stores the identity, and only
        checkpoints that store it are resumed into this folder. Returns the id."""
        run_id = uuid.uuid4().hex
        if is_primary():
            write_atomically(self.run_dir / RUN_FILE, json.dumps({"run_id": run_id}) + "\n")
        return run_id

    @property
    def set_aside(self) -> Path:
        """Where damaged, foreign or unverifiable checkpoints are moved: inside the
        checkpoint folder, so the move is a rename on the same filesystem."""
        return self.folder / "damaged"

    def latest_step(self) -> int | None:
        """The newest step on disk (None: none)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every step on disk."""
        return list(self.manager.all_steps())

    def close(self) -> None:
        """Release the Orbax manager."""
        self.manager.close()

    def save(self, step: int, state: Any, fingerprint: dict, extras: dict) -> None:
        """Write checkpoint ``step`` (atomic: a crash leaves the previous one) and, on
        process 0, its SHA-256 sums. Arrays identical on every worker are written once
        (:func:`collapse_rows`). The run's identity and the step are stored beside the
        fingerprint: a checkpoint proves which run and step it is."""
        saved, once = collapse_rows(state)
        run_id = read_run_id(self.run_dir) if is_primary() else ""
        if run_id is None:  # a folder written before run identities, or a bare store
            run_id = self.start_run()
        meta = {**fingerprint, "run_id": run_id, "step": int(step)}
        with _whole_replicas():
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(saved),
                    meta=ocp.args.JsonSave(meta),
                    extras=ocp.args.JsonSave(extras),
                    rows=ocp.args.JsonSave({"once": once}),
                ),
                force=True,
            )
            self.manager.wait_until_finished()
        if is_primary():
            write_checksums(self.run_dir, step, self.manager.all_steps())
        self.saved_step = step

    def _restore_resized(
        self,
        step: int,
        template: Any,
        once: list[str],
        old_n: int,
        new_n: int,
        per_worker: tuple[str, ...],
    ) -> Any:
        """Checkpoint ``step`` of ``old_n`` workers as a state of ``new_n`` workers in
        ``template``'s shapes and shardings: every array read whole on the host (in the
        shapes it was saved in), the ``per_worker`` entries mapped by
        :func:`jaxcomm.elastic.resize_workers`, then placed on the devices."""
        import jaxcomm

        json_item = ocp.JsonCheckpointHandler
        reader = ocp.CheckpointManager(
            self.folder.absolute(),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                **{k: json_item() for k in ("meta", "extras", "rows")},
            },
        )
        try:
            saved = reader.item_metadata(step)["state"]
            shapes = {
                _path_names(p): (tuple(m.shape), np.dtype(m.dtype))
                for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]
            }
            missing = []

            def target(path: Any, a: Any) -> np.ndarray:
                found = shapes.get(_path_names(path))
                if found is None:
                    missing.append(jax.tree_util.keystr(path))
                    return np.zeros(a.shape, a.dtype)
                return np.zeros(*found)

            host_target = jax.tree_util.tree_map_with_path(target, template)
            if missing:
                raise ValueError(
                    f"checkpoint step {step} in {str(self.folder)!r} has no array {missing[0]}"
                )
            state = reader.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(host_target))
            )["state"]
        finally:
            reader.close()
        names = set(once)
        rowed = {
            jax.tree_util.keystr(path)
            for path, a in jax.tree_util.tree_flatten_with_path(template)[0]
            if has_rows(a)
        }

        wants = {
            jax.tree_util.keystr(path): tuple(a.shape)
            for path, a in jax.tree_util.tree_flatten_with_path(template)[0]
        }

        def rows(path: Any, a: Any) -> np.ndarray:
            a = np.asarray(a)
            name = jax.tree_util.keystr(path)
            if name in names and name in rowed:  # saved once: every worker's row
                return np.broadcast_to(a[None], (old_n, *a.shape))
            if name not in rowed and a.ndim and a.shape[1:] == wants.get(name):
                # Held once now, saved one row per worker by an earlier version: the rows
                # must agree.
                flat = np.ascontiguousarray(a).reshape(a.shape[0], -1).view(np.uint8)
                if not (flat == flat[:1]).all():
                    raise ValueError(
                        f"{name}: the checkpoint's workers hold different rows of state this "
                        "run holds once; it cannot be resumed into this run"
                    )
                return a[0]
            return a

        state = jax.tree_util.tree_map_with_path(rows, state)
        # Only the arrays with a row per worker change; one copy stays as it is.
        mine = jax.tree_util.tree_map_with_path(
            lambda path, a: a if jax.tree_util.keystr(path) in rowed else None,
            {k: state[k] for k in per_worker},
        )
        resized = jaxcomm.elastic.resize_workers(mine, new_n) if new_n != old_n else None
        if resized is None:  # the same workers: only the earlier layout's shapes change
            resized = jaxcomm.elastic.Resized(mine, {})
        new = {
            jax.tree_util.keystr(path): a
            for path, a in jax.tree_util.tree_flatten_with_path(resized.state)[0]
        }
        state = jax.tree_util.tree_map_with_path(
            lambda path, a: new.get(jax.tree_util.keystr(path), a), state
        )
        if new_n == old_n:
            return self._place(state, template, new_n)
        print(
            f"resuming a run of {old_n} workers on {new_n} (checkpoint step {step}); state "
            "kept bit for bit unless named here:",
            flush=True,
        )
        for name, note in resized.notes.items():
            print(f"  {name}: {note}", flush=True)

        return self._place(state, template, new_n)

    @staticmethod
    def _place(state: Any, template: Any, new_n: int) -> Any:
        """Host arrays ``state`` on the devices in ``template``'s shapes and shardings."""

        def place(path: Any, a: np.ndarray, want: Any) -> Any:
            if np.shape(a) != tuple(want.shape):
                raise ValueError(
                    f"{jax.tree_util.keystr(path)} is {list(np.shape(a))} on {new_n} workers, "
                    f"the run needs {list(want.shape)}: it cannot be resized"
                )
            sharding = getattr(want, "sharding", None)
            if sharding is None:
                return np.asarray(a, want.dtype)
            full = np.asarray(a, want.dtype)
            return jax.make_array_from_callback(full.shape, sharding, lambda i: full[i])

        return jax.tree_util.tree_map_with_path(place, state, template)

    def _earlier_layout(self, step: int, template: Any, once: list[str]) -> bool:
        """Whether checkpoint ``step`` holds an array in another shape than ``template``
        asks (one row per worker of state now held once, as earlier versions saved it)."""
        reader = ocp.CheckpointManager(
            self.folder.absolute(), item_handlers={"state": ocp.StandardCheckpointHandler()}
        )
        try:
            saved = reader.item_metadata(step)["state"]
        finally:
            reader.close()
        shapes = {
            _path_names(p): tuple(m.shape)
            for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]
        }
        targets = jax.tree_util.tree_flatten_with_path(_row_targets(template, once))[0]
        return any(shapes.get(_path_names(p)) not in (None, tuple(t.shape)) for p, t in targets)

    def _problem(self, step: int, mine: dict | None) -> str | None:
        """Why checkpoint ``step`` cannot be resumed into this run folder, or None: the run
        and step it stores, and its files against their sums, all checked; an
        :class:`Unverified` only when nothing proves it wrong but something cannot be
        checked (no sums, no run identity)."""
        problems = [
            _identity_problem(self.run_dir, step, read_run_id(self.run_dir), mine),
            verify_checksums(self.run_dir, step),
        ]
        wrong = [p for p in problems if p is not None and not isinstance(p, Unverified)]
        unknown = [p for p in problems if isinstance(p, Unverified)]
        return wrong[0] if wrong else unknown[0] if unknown else None

    def _adopt_identity(self, step: int) -> None:
        """Give a run folder without ``run.json`` the identity that checkpoint ``step``
        (resumed unverified) stores, so its older checkpoints stay this run's."""
        if read_run_id(self.run_dir) is not None:
            return
        path = self.folder / str(step) / "meta" / "metadata"
        try:
            run_id = json.loads(path.read_text()).get("run_id")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return
        if isinstance(run_id, str) and run_id:
            write_atomically(self.run_dir / RUN_FILE, json.dumps({"run_id": run_id}) + "\n")

    def _move_aside(self, step: int, why: str) -> Path:
        """Move checkpoint ``step`` into :attr:`set_aside`, with a note of why, and its sums
        to ``checksums/<name>.set-aside``; nothing is deleted. Returns where it went."""
        self.set_aside.mkdir(exist_ok=True)
        aside, n = self.set_aside / str(step), 1
        while aside.exists() or aside.with_name(aside.name + ".why").exists():
            aside, n = self.set_aside / f"{step}.{n}", n + 1
        os.replace(self.folder / str(step), aside)
        sums = self.run_dir / "checksums" / f"{step}.json"
        if sums.exists():  # beside the others (checkpoints/ may be another filesystem)
            os.replace(sums, sums.with_name(f"{aside.name}.set-aside"))
        write_atomically(aside.with_name(aside.name + ".why"), why + "\n")
        return aside

    def _newest_intact(
        self, steps: list[int], mine: dict | None = None, allow_unverified: bool = False
    ) -> tuple[int, list[str]]:
        """``(step, refused)``: the newest checkpoint of ``steps`` (newest first) whose
        files match their sums and which proves it belongs to this run and step, or -1, and
        a line per one refused. Unverifiable ones (:class:`Unverified`) are taken only with
        ``allow_unverified``. The refused ones newer than the step are moved into
        :attr:`set_aside` (kept for inspection, out of the way of the steps about to be
        saved); when none is usable nothing is moved."""
        refused: list[tuple[int, str]] = []
        for step in steps:
            problem = self._problem(step, mine)
            if problem is None:
                break
            if isinstance(problem, Unverified) and allow_unverified:
                print(
                    f"checkpoint step {step} cannot be verified ({problem}); using it as "
                    "--allow-unverified asks",
                    file=sys.stderr,
                    flush=True,
                )
                self._adopt_identity(step)
                break
            refused.append((step, problem))
            hint = (
                " (it is set aside in checkpoints/damaged/; to resume from it instead, stop "
                "this run, move it back to checkpoints/, delete the newer steps this run "
                "wrote there and resume with --allow-unverified)"
                if isinstance(problem, Unverified)
                else ""
            )
            print(
                f"checkpoint step {step} in {str(self.folder)!r} is not resumed: {problem}"
                f"{hint}; trying the next older one",
                file=sys.stderr,
                flush=True,
            )
        else:
            return -1, [_reason(s, p) for s, p in refused]
        for s, problem in refused:
            aside = self._move_aside(s, f"checkpoint step {s} not resumed: {problem}")
            print(f"checkpoint step {s} set aside in {str(aside)!r}", file=sys.stderr, flush=True)
        if refused:
            print(f"resuming from checkpoint step {step}", file=sys.stderr, flush=True)
        return step, [_reason(s, p) for s, p in refused]

    def restore(
        self,
        template: Any,
        fingerprint: dict,
        per_worker: tuple[str, ...] = (),
        *,
        allow_unverified: bool = False,
    ) -> tuple[int, Any, dict] | None:
        """``(step, state, extras)`` of the newest intact checkpoint, the state in
        ``template``'s structure, shapes and shardings; None when there is none. Raises
        on a different run's checkpoint (naming what differs), or when every checkpoint
        is damaged.

        Each checkpoint's files must be exactly those its SHA-256 sums, written when it
        was committed (``<run>/checksums/<step>.json``), list, with those sums; it must
        store this folder's run identity (``run.json``) and its own folder's step. One that
        fails is named in one line, with what differs, and the next older one is tried;
        the refused ones are moved into ``checkpoints/damaged/``. A checkpoint that cannot
        be verified (no sums: its writer stopped between the commit and the sums; or one
        written before run identities) is used only with ``allow_unverified``.

        ``per_worker`` names the entries of ``template`` stacked over workers (a leading
        axis of ``fingerprint["workers"]`` rows). When given, a checkpoint that differs from
        the fingerprint in ``workers`` only is resumed on the new number of workers: those
        entries are read whole and mapped by :func:`jaxcomm.elastic.resize_workers`, with a line
        per array it averaged or re-cut."""
        manager = self.manager
        steps = sorted(manager.all_steps(), reverse=True)
        if not steps:
            return None
        # Process 0 checks the files and moves damaged checkpoints aside; the others wait
        # for its choice, so no process reads a folder while it moves.
        multi = jax.process_count() > 1
        if multi:
            from jax.experimental import multihost_utils
        damaged: list[str] = []
        latest = -1
        mine = json.loads(json.dumps(fingerprint))
        if is_primary():
            latest, damaged = self._newest_intact(steps, mine, allow_unverified)
        if multi:
            latest = int(multihost_utils.broadcast_one_to_all(np.asarray(latest, np.int64)))
        if latest < 0:
            unverified = any(isinstance(d, Unverified) for d in damaged)
            raise ValueError(
                f"no checkpoint in {str(self.folder)!r} can be resumed into this run"
                + (": " + "; ".join(damaged) if damaged else " (see process 0's log)")
                + (unverified and "; --allow-unverified resumes an unverifiable one" or "")
            )
        if latest != steps[0]:  # the newer ones were damaged and are moved aside now
            if multi:
                multihost_utils.sync_global_devices("jaxcomm_damaged_checkpoints_moved")
            manager.reload()
        meta = manager.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        meta = {k: v for k, v in meta.items() if k not in ("run_id", "step")}
        changed = _changed_step_sizes(
            meta.get("aggregator_args"), mine.get("aggregator_args"), mine.get("step_sizes")
        )
        if changed is not None:  # step sizes may change on resume; nothing else may
            meta = {**meta, "aggregator_args": mine.get("aggregator_args")}
        changed = {f"aggregator_args.{k}": v for k, v in (changed or {}).items()}
        if "lr" in meta and "lr" in mine and meta["lr"] != mine["lr"]:
            changed["lr"] = (meta["lr"], mine["lr"])
            meta = {**meta, "lr": mine["lr"]}
        if "lr" in mine and "lr" not in meta:  # written before the lr was part of it
            meta = {**meta, "lr": mine["lr"]}
        diff = {k: (meta.get(k), v) for k, v in mine.items() if meta.get(k) != v}
        # A different number of workers (and nothing else) is a resize: see resize_workers.
        diff_world = {k: diff.pop(k) for k in ("workers",) if k in diff and per_worker}
        if diff:
            details = "; ".join(
                "parameter shapes differ" if k == "param_shapes"
                else "; ".join(f"{k}{sub}: checkpoint {x!r} vs config {y!r}"
                               for sub, x, y in _differences(a, b))
                for k, (a, b) in diff.items()
            )  # fmt: skip
            raise ValueError(
                f"checkpoint directory {str(self.folder)!r} holds a different run "
                f"({details}); resume with its settings, or use --set name=<new name>"
            )
        for key, (old, new) in changed.items():
            if is_primary():
                print(f"resuming with {key} changed: {old!r} -> {new!r}", flush=True)
        try:
            once = manager.restore(latest, args=ocp.args.Composite(rows=ocp.args.JsonRestore()))[
                "rows"
            ]["once"]
        except (KeyError, ValueError, FileNotFoundError):
            once = []  # a checkpoint that saved every worker's rows
        if "workers" in diff_world:
            old_n, new_n = diff_world["workers"]
            state = self._restore_resized(latest, template, once, old_n, new_n, per_worker)
        elif self._earlier_layout(latest, template, once):
            n = mine["workers"]
            state = self._restore_resized(latest, template, once, n, n, per_worker)
        else:
            target = _row_targets(template, once)
            state = manager.restore(
                latest, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )["state"]
            state = expand_rows(state, template, once)
        try:
            extras = manager.restore(
                latest, args=ocp.args.Composite(extras=ocp.args.JsonRestore())
            )["extras"]
        except (KeyError, ValueError, FileNotFoundError):
            extras = {}  # a checkpoint written before host-side extras were saved
        self.saved_step = latest
        return latest, state, extras


def _differences(a: Any, b: Any, where: str = "") -> list[tuple[str, Any, Any]]:
    """``(.key.path, a's value, b's value)`` where two fingerprint entries differ (mappings
    compared key by key, so a changed model width is named, not the whole model)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
                for d in _differences(a.get(k), b.get(k), f"{where}.{k}")]  # fmt: skip
    return [(where, a, b)]


# ---------------------------------------------------------------------- a trainer's state


def run_fingerprint(ctx: Context) -> dict[str, Any]:
    """What a checkpoint must match to be resumed into run ``ctx``: the run's settings
    that shape its state, its parts' (layout, synchronisation, controller) entries and the
    parameter shapes."""
    cfg = ctx.cfg
    shapes = jax.tree_util.tree_map(
        lambda a: list(a.shape[1:] if has_rows(a) else a.shape), ctx.params
    )
    fields = lambda section: {k: v for k, v in section.to_dict().items() if k != "name"}  # noqa: E731
    return {
        "task": cfg.task,
        "model": fields(cfg.model),
        "dataset": cfg.dataset,
        "workers": ctx.n,
        "global_batch": cfg.global_batch,
        "seed": cfg.seed,
        "optimizer": cfg.optimizer.name,
        "lr": cfg.optimizer.lr,
        # The schedule, weight decay and clipping, when set (a run without them keeps the
        # fingerprint it always had).
        **cfg.optimizer.settings(cfg.steps),
        "aggregator": cfg.aggregator.key,
        "aggregator_args": fields(cfg.aggregator),
        "step_sizes": list(type(cfg.aggregator).step_sizes),
        **{k: v for part in ctx.parts for k, v in part.fingerprint().items()},
        "param_shapes": jax.tree_util.tree_flatten_with_path(shapes)[0].__repr__(),
    }


def _state_tree(ctx: Context) -> dict[str, Any]:
    """Everything run ``ctx`` saves as arrays: the layout's parameters and optimizer
    state, the step, the loader position and the simulated clock."""
    parts = {type(p).__name__: p.saved_arrays() for p in ctx.parts}
    parts = {k: v for k, v in parts.items() if v}
    return {
        **ctx.layout.state_tree(ctx),
        **({"parts": parts} if parts else {}),
        "step": np.asarray(ctx.step, np.int64),
        "loader_position": np.asarray(ctx.loader.position, np.int64),
        "clock": np.asarray(ctx.clock.now, np.float64),
    }


def save_run(ctx: Context, store: Checkpoints) -> None:
    """Checkpoint run ``ctx`` at its current step (atomic: a crash leaves the previous
    one): the layout's host state first (e.g. message-buffer snapshots), then the arrays,
    the fingerprint and the parts' host-side extras (JSON) in one Orbax commit."""
    ctx.layout.before_save(ctx, store)
    extras: dict[str, Any] = {}
    for part in ctx.parts:
        extras.update(part.checkpoint_extras())
    store.save(ctx.step, _state_tree(ctx), run_fingerprint(ctx), extras)
    ctx.store = store
    ctx.layout.after_save(ctx, store)


def restore_run(ctx: Context, store: Checkpoints, *, allow_unverified: bool = False) -> bool:
    """Load the newest intact checkpoint of ``store`` into run ``ctx`` (see
    :meth:`Checkpoints.restore`): state, parts' extras, step, loader position, clock and
    the layout's host state; False when there is none."""
    ctx.store = store
    found = store.restore(
        _state_tree(ctx),
        run_fingerprint(ctx),
        per_worker=("params", "opt_state"),
        allow_unverified=allow_unverified,
    )
    if found is None:
        return False
    step, state, extras = found
    if int(state["step"]) != step:
        raise ValueError(
            f"checkpoint {str(store.folder / str(step))!r} holds the state of step "
            f"{int(state['step'])}, not {step}: it was renamed; move it back to "
            f"{str(store.folder / str(int(state['step'])))!r} or out of the folder"
        )
    ctx.layout.set_state(ctx, state["params"], state["opt_state"])
    for part in ctx.parts:
        part.restore_extras(ctx, extras)
        arrays = state.get("parts", {}).get(type(part).__name__)
        if arrays:
            part.load_arrays(ctx, arrays)
    ctx.step = step
    ctx.loader.restore({"position": int(state["loader_position"]), "seed": ctx.cfg.seed})
    ctx.clock.restore({"now": float(state["clock"]), "overlap": ctx.cfg.overlap})
    ctx.layout.after_restore(ctx)
    return True
