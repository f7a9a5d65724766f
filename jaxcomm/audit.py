"""Wire audit: the bytes a compiled step's collectives move, read from the program itself.

:func:`wire_audit` takes a compiled (or lowered) JAX program, reads the collective operations
of its optimized HLO (``collective-permute``, ``all-gather``, ``all-reduce``,
``reduce-scatter``, ``all-to-all``, synchronous or as ``-start`` ops), multiplies each by the
trip counts of the loops around it (XLA records ``known_trip_count`` on every ``while`` whose
count it can prove; a collective inside a loop without one is an error naming the loop), and
returns, per device, the bytes sent, the sequential message rounds and the bytes along those
rounds. Nothing is taken from jaxcomm's own byte accounting, so comparing the two checks it.

How each collective counts (bytes a device sends per execution, rounds):

=================== ===================================================== ==========
collective-permute  its operand, on devices that are a source of a pair   1
all-gather          ``(N - 1) *`` its operand                            ``N - 1``
reduce-scatter      ``(N - 1) *`` its result (``operand / N``)           ``N - 1``
all-to-all          ``(N - 1) / N *`` its operands                       ``N - 1``
all-reduce          ``2 (N - 1) * ceil(size / N) * itemsize`` per array  ``2 (N - 1)``
=================== ===================================================== ==========

``N`` is the size of the device's replica group. XLA's own collectives have no fixed
algorithm, so they are counted as the bandwidth-optimal ring (pairwise exchange for
all-to-all), the same convention jaxcomm's logs use for ``psum`` and ``all_to_all``; jaxcomm's
rings and trees are ``collective-permute`` s, counted exactly. A round's path bytes are the
largest number of bytes any device sends in it.

Collectives inside a ``conditional`` (``lax.cond``/``lax.switch``) run only when their branch
is taken, which the program alone cannot tell. The audit lists them per branch; resolve them
with ``branches=`` (one branch for every device, one per device, or, for a conditional inside
a loop, how many of its executions take each branch), and it raises when a conditional
holding collectives is left unresolved.

Asynchronous collectives count once: the ``-start`` op of a native pair, or the collective
wrapped by an ``async-start`` (its ``async-update`` and ``async-done`` move nothing more).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["CollectiveOp", "Traffic", "WireAudit", "wire_audit"]

_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "f8e4m3fn": 8,
    "f8e5m2": 8,
    "f8e4m3": 8,
    "f8e4m3b11fnuz": 8,
    "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
}
_ARRAY_RE = re.compile(
    r"\b(" + "|".join(sorted(_DTYPE_BITS, key=len, reverse=True)) + r")\[([\d,]*)\]"
)
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COLLECTIVES = {
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "reduce-scatter-start": "reduce-scatter",
    "all-to-all": "all-to-all",
    "all-to-all-start": "all-to-all",
    "ragged-all-to-all": None,
    "collective-broadcast": None,
    "send": None,
    "recv": None,
}


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of the compiled program.

    Attributes:
      name: HLO instruction name.
      kind: ``collective-permute``, ``all-gather``, ``all-reduce``, ``reduce-scatter`` or
        ``all-to-all``.
      op_name: the JAX operation it came from (HLO metadata), e.g. ``.../while/body/ppermute``.
      count: executions per run of the program (product of the enclosing loops' trip counts).
      branches: enclosing conditionals as ``(conditional name, branch index)``, outermost
        first; empty when the collective always runs.
      sent: ``int64[D]`` bytes each device sends in one execution.
      rounds: sequential message rounds of one execution.
    """

    name: str
    kind: str
    op_name: str
    count: int
    branches: tuple[tuple[str, int], ...]
    sent: np.ndarray
    rounds: int

    @property
    def path_bytes(self) -> int:
        """Bytes along one execution's rounds: the most any device sends, per round."""
        return int(self.sent.max()) if self.sent.size else 0


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Per-device totals of a program run (one entry per device, in partition order).

    Attributes:
      sent: ``int64[D]`` bytes each device sends.
      rounds: ``int64[D]`` sequential message rounds of the collectives each device runs.
      path_bytes: ``int64[D]`` bytes along those rounds.
    """

    sent: np.ndarray
    rounds: np.ndarray
    path_bytes: np.ndarray


@dataclasses.dataclass(frozen=True)
class WireAudit:
    """The collectives of a compiled program (see :func:`wire_audit`).

    Attributes:
      num_devices: devices (SPMD partitions) the program runs on; device ``d`` is mesh
        position ``d`` in row-major order.
      ops: every collective found.
      conditionals: ``{conditional name: JAX op name}`` of the conditionals that hold
        collectives (keys for ``branches=``).
      conditional_counts: ``{conditional name: executions per run}`` (the trip counts of the
        loops around it; 1 outside loops).
    """

    num_devices: int
    ops: tuple[CollectiveOp, ...]
    conditionals: dict[str, str]
    conditional_counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def _executions(self, name: str, value: Any) -> np.ndarray:
        """``int64[D, B]``: executions of each branch of conditional ``name`` on each device."""
        total = self.conditional_counts.get(name, 1)
        if isinstance(value, Mapping):
            counts = {}
            for b, k in value.items():
                if not (isinstance(b, (int, np.integer)) and b >= 0):
                    raise ValueError(f"branches[{name!r}]: branch {b!r} is not an index >= 0")
                if not (isinstance(k, (int, np.integer)) and k >= 0):
                    raise ValueError(
                        f"branches[{name!r}][{b}] = {k!r}: executions must be an int >= 0"
                    )
                counts[int(b)] = int(k)
            if sum(counts.values()) != total:
                raise ValueError(
                    f"branches[{name!r}] = {dict(value)} counts {sum(counts.values())} "
                    f"executions, but the conditional runs {total} times per run"
                )
            table = np.zeros((self.num_devices, max(counts, default=0) + 1), np.int64)
            for b, k in counts.items():
                table[:, b] = k
            return table
        choice = np.broadcast_to(np.asarray(value, np.int64), (self.num_devices,))
        if (choice < 0).any():
            raise ValueError(f"branches[{name!r}] = {value!r}: branch indices must be >= 0")
        table = np.zeros((self.num_devices, int(choice.max()) + 1), np.int64)
        table[np.arange(self.num_devices), choice] = total
        return table

    def _resolve(self, branches: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
        branches = dict(branches or {})
        out: dict[str, np.ndarray] = {}
        for key, value in branches.items():
            if key in self.conditionals:
                names = [key]
            else:
                names = [c for c, op in self.conditionals.items() if key in op]
            if len(names) != 1:
                raise ValueError(
                    f"branches key {key!r} must name exactly one conditional holding "
                    f"collectives (by HLO name or a part of its op name); it matches "
                    f"{len(names)}. Conditionals: {self.conditionals}"
                )
            out[names[0]] = self._executions(names[0], value)
        missing = {c: op for c, op in self.conditionals.items() if c not in out}
        if missing:
            raise ValueError(
                "the program holds collectives inside conditionals, whose branch the program "
                f"alone cannot tell; pass branches={{name: branch index}} for {missing}"
            )
        return out

    def traffic(self, branches: Mapping[str, Any] | None = None) -> Traffic:
        """Per-device bytes sent, rounds and path bytes of one run of the program.

        Args:
          branches: for each conditional holding collectives, the branch index taken, as an
            int (every device, every execution) or ``int[D]`` (per device), or, when the
            conditional runs several times per run (inside a loop), ``{branch: executions}``
            summing to :attr:`conditional_counts` (every device). Keys are conditional names
            or a unique part of their op name (a ``jax.named_scope`` shows there).
        """
        taken = self._resolve(branches)
        # Conditionals given as branch counts (a share per branch rather than one branch).
        counted = {c for c, table in taken.items() if (table > 0).sum(1).max() > 1}
        d = self.num_devices
        sent = np.zeros(d, np.int64)
        rounds = np.zeros(d, np.int64)
        path = np.zeros(d, np.int64)
        for op in self.ops:
            # Executions of this op: its count scaled, per enclosing conditional, by the share
            # of that conditional's executions that take the op's branch.
            if sum(c in counted for c, _ in op.branches) > 1:
                raise ValueError(
                    f"{op.name} sits in nested conditionals "
                    f"{[c for c, _ in op.branches]}; give branch counts for at most one of them"
                )
            num = np.full(d, op.count, np.int64)
            den = 1
            for cond, branch in op.branches:
                table = taken[cond]
                num *= table[:, branch] if branch < table.shape[1] else 0
                den *= self.conditional_counts.get(cond, 1)
            runs = num // den
            sent += runs * op.sent
            rounds += runs * op.rounds
            path += runs * op.path_bytes
        return Traffic(sent=sent, rounds=rounds, path_bytes=path)

    def sent_bytes(self, branches: Mapping[str, Any] | None = None) -> np.ndarray:
        """``int64[D]``: bytes each device sends in one run (see :meth:`traffic`)."""
        return self.traffic(branches).sent


# --------------------------------------------------------------------------- HLO parsing


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


def _matching(text: str, start: int, open_c: str, close_c: str) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_c:
            depth += 1
        elif text[i] == close_c:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_c}{close_c} in HLO line: {text[:200]!r}")


def _parse_instr(line: str) -> _Instr | None:
    m = _NAME_RE.match(line)
    if m is None:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _matching(rest, 0, "(", ")")
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape, rest = rest[:end], rest[end:].lstrip()
    om = re.match(r"([\w\-]+)\(", rest)
    if om is None:
        return None
    close = _matching(rest, om.end() - 1, "(", ")")
    operands = re.findall(r"%([\w.\-]+)", rest[om.end() : close - 1])
    return _Instr(m.group(1), shape, om.group(1), operands, rest[close:])


def _arrays(shape: str) -> list[tuple[int, int]]:
    """``[(elements, bits per element)]`` of the arrays in an HLO shape (tuples flattened)."""
    out = []
    for dtype, dims in _ARRAY_RE.findall(shape):
        out.append((math.prod(int(x) for x in dims.split(",") if x), _DTYPE_BITS[dtype]))
    return out


def _nbytes(shape: str) -> int:
    return sum(-(-n * bits // 8) for n, bits in _arrays(shape))


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(r"\b" + re.escape(key) + r"=", attrs)
    if m is None:
        return None
    i = m.end()
    if i < len(attrs) and attrs[i] == "{":
        return attrs[i : _matching(attrs, i, "{", "}")]
    if i < len(attrs) and attrs[i] == "[":  # iota replica groups: [2,4]<=[8] or ...T(1,0)
        m2 = re.match(r"\[[\d,]*\]<=\[[\d,]*\](T\([\d,]*\))?", attrs[i:])
        if m2:
            return m2.group(0)
    m2 = re.match(r"[^,\s}]+", attrs[i:])
    return m2.group(0) if m2 else None


def _groups(attrs: str, num_devices: int) -> list[list[int]]:
    text = _attr(attrs, "replica_groups")
    if text is None or text in ("{}", "{{}}"):
        return [list(range(num_devices))]
    if text.startswith("["):
        m = re.match(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", text)
        assert m is not None
        out_shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    return [
        [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text)
    ]


def _computations(hlo: str) -> tuple[dict[str, list[_Instr]], str, int]:
    comps: dict[str, list[_Instr]] = {}
    entry = ""
    current: list[_Instr] | None = None
    m = re.search(r"num_partitions=(\d+)", hlo)
    partitions = int(m.group(1)) if m else 1
    m = re.search(r"replica_count=(\d+)", hlo)
    replicas = int(m.group(1)) if m else 1
    for line in hlo.splitlines():
        if current is None:
            cm = _COMP_RE.match(line)
            if cm and "=" not in line.split("(")[0]:
                current = comps.setdefault(cm.group(2), [])
                if cm.group(1):
                    entry = cm.group(2)
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            current.append(instr)
    if not entry:
        raise ValueError("no ENTRY computation found: is this an HLO module's text?")
    return comps, entry, max(partitions, replicas)


def _comp_names(text: str | None) -> list[str]:
    return re.findall(r"%?([\w.\-]+)", text) if text else []


def _op_name(attrs: str) -> str:
    m = re.search(r'op_name="([^"]*)"', attrs)
    return m.group(1) if m else ""


def _collective(instr: _Instr, shapes: dict[str, str], d: int) -> tuple[np.ndarray, int]:
    kind = _COLLECTIVES[instr.opcode]
    operand_shapes = [shapes.get(o, "") for o in instr.operands]
    sent = np.zeros(d, np.int64)
    if kind == "collective-permute":
        if _attr(instr.attrs, "slice_sizes") is not None:
            raise ValueError(
                f"collective-permute {instr.name} ({_op_name(instr.attrs)!r}) is the in-place "
                "slice form, which the wire audit does not count"
            )
        pairs = re.findall(r"\{(\d+),(\d+)\}", _attr(instr.attrs, "source_target_pairs") or "")
        # A combined permute sends every operand along the same pairs.
        nbytes = sum(_nbytes(s) for s in operand_shapes) if operand_shapes else 0
        nbytes = nbytes or _nbytes(instr.shape)
        for src, _ in pairs:
            sent[int(src)] += nbytes
        return sent, 1
    groups = _groups(instr.attrs, d)
    rounds = 0
    for group in groups:
        n = len(group)
        if kind == "all-gather":
            per = (n - 1) * sum(_nbytes(s) for s in operand_shapes)
        elif kind == "reduce-scatter":
            per = (n - 1) * sum(_nbytes(s) // n for s in operand_shapes)
        elif kind == "all-to-all":
            per = (n - 1) * sum(_nbytes(s) for s in operand_shapes) // n
        else:  # all-reduce, as a ring of ceil(size / N)-element segments
            per = 0
            for s in operand_shapes:
                for elems, bits in _arrays(s):
                    seg = -(-elems // n)
                    per += 2 * (n - 1) * (-(-seg * bits // 8))
        for dev in group:
            sent[dev] += per
        rounds = max(rounds, 2 * (n - 1) if kind == "all-reduce" else n - 1)
    return sent, rounds


def wire_audit(program: Any) -> WireAudit:
    """The collectives of a compiled program and the bytes they move, per device.

    Args:
      program: a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``), a
        ``jax.stages.Lowered`` (compiled here), or the text of an optimized HLO module.

    Returns:
      A :class:`WireAudit`; ``.traffic(branches)`` gives per-device totals.

    Raises:
      ValueError: a collective sits inside a loop whose trip count XLA could not determine,
        or the program holds a collective this audit does not know how to count.

    Example::

        step = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=..., out_specs=...))
        audit = jaxcomm.wire_audit(step.lower(params, batch).compile())
        audit.sent_bytes()          # int64[8]: bytes each device sends per step
    """
    if isinstance(program, jax.stages.Lowered):
        program = program.compile()
    if isinstance(program, jax.stages.Compiled):
        hlo = program.as_text()
    elif isinstance(program, str):
        hlo = program
    else:
        raise TypeError(
            "program must be a jax.stages.Compiled, a jax.stages.Lowered or the text of an "
            f"optimized HLO module, got {type(program).__name__}"
        )
    comps, entry, d = _computations(hlo)
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    ops: list[CollectiveOp] = []
    conditionals: dict[str, str] = {}

    def walk(comp: str, count: int, path: tuple, loop: str | None, seen: tuple) -> None:
        if comp in seen:
            return
        for instr in comps.get(comp, []):
            if instr.opcode in _COLLECTIVES:
                if _COLLECTIVES[instr.opcode] is None:
                    raise ValueError(
                        f"collective {instr.opcode} ({instr.name}, {_op_name(instr.attrs)!r}) "
                        "is not counted by the wire audit"
                    )
                if loop is not None:
                    raise ValueError(
                        f"collective {instr.name} ({_op_name(instr.attrs)!r}) sits in the loop "
                        f"{loop}, whose trip count XLA could not determine"
                    )
                sent, rounds = _collective(instr, shapes, d)
                kind = _COLLECTIVES[instr.opcode]
                ops.append(
                    CollectiveOp(instr.name, kind, _op_name(instr.attrs), count, path, sent, rounds)
                )
                for cond, _ in path:
                    conditionals.setdefault(cond, _cond_names[cond])
            elif instr.opcode == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
                body = _comp_names(_attr(instr.attrs, "body"))
                cond = _comp_names(_attr(instr.attrs, "condition"))
                label = f"{instr.name} ({_op_name(instr.attrs)!r})"
                if m:
                    trips = int(m.group(1))
                    for c in body:
                        walk(c, count * trips, path, loop, seen + (comp,))
                    for c in cond:
                        walk(c, count * (trips + 1), path, loop, seen + (comp,))
                else:
                    for c in body + cond:
                        walk(c, count, path, loop or label, seen + (comp,))
            elif instr.opcode == "conditional":
                names = _comp_names(_attr(instr.attrs, "branch_computations"))
                if not names:  # true_computation / false_computation form: index 0 is true
                    names = _comp_names(_attr(instr.attrs, "true_computation")) + _comp_names(
                        _attr(instr.attrs, "false_computation")
                    )
                _cond_names[instr.name] = _op_name(instr.attrs)
                _cond_counts[instr.name] = _cond_counts.get(instr.name, 0) + count
                for b, c in enumerate(names):
                    walk(c, count, path + ((instr.name, b),), loop, seen + (comp,))
            elif instr.opcode in ("async-update", "async-done"):
                continue  # the wrapped collective was counted at its async-start
            else:
                for key in ("calls", "to_apply"):
                    for c in _comp_names(_attr(instr.attrs, key)):
                        walk(c, count, path, loop, seen + (comp,))

    _cond_names: dict[str, str] = {}
    _cond_counts: dict[str, int] = {}
    walk(entry, 1, (), None, ())
    return WireAudit(
        num_devices=d,
        ops=tuple(ops),
        conditionals=conditionals,
        conditional_counts={c: _cond_counts[c] for c in conditionals},
    )
