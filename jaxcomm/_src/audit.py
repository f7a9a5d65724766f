"""What a compiled step costs, read from the program itself: wire bytes and compute.

:func:`wire_audit` gives the bytes the collectives move per device; :func:`program_cost`
gives the flops and memory bytes of the same program (see its docstring). Both multiply
what runs in a loop by the loop's trip count and resolve conditionals the same way.

:func:`wire_audit` takes a compiled (or lowered) JAX program, reads the collective operations
of its optimized HLO (``collective-permute``, ``all-gather``, ``all-reduce``,
``reduce-scatter``, ``all-to-all``, synchronous or as ``-start`` ops), multiplies each by the
trip counts of the loops around it (XLA records ``known_trip_count`` on every ``while`` whose
count it can prove; a collective inside a loop without one is an error naming the loop), and
returns, per device, the bytes sent, the sequential message rounds and the bytes along those
rounds. Nothing is taken from jaxcomm's own byte accounting, so comparing the two checks it.

How each collective counts (bytes a device sends per execution, rounds):

================== =================================================== =============
collective-permute its operand, on devices that are a source of a pair 1
all-gather         ``(N - 1) *`` its operand                           ``N - 1``
reduce-scatter     ``(N - 1) *`` its result (``operand / N``)          ``N - 1``
all-to-all         ``(N - 1) / N *`` its operands                      ``N - 1``
all-reduce         ``2 (N - 1) * ceil(size / N) * itemsize`` per array ``2 (N - 1)``
================== =================================================== =============

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
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxcomm._src.codecs import SAMPLE_TOPK_SCOPE

__all__ = [
    "CollectiveOp",
    "ComputeCost",
    "ProgramCost",
    "Traffic",
    "UnloggedTrafficError",
    "WireAudit",
    "check_logged_traffic",
    "program_cost",
    "unlogged_traffic",
    "wire_audit",
]

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
      shape: its HLO result shape, e.g. ``f32[4,3]{1,0}``.
    """

    name: str
    kind: str
    op_name: str
    count: int
    branches: tuple[tuple[str, int], ...]
    sent: np.ndarray
    rounds: int
    shape: str = ""

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


class _Branches:
    """Resolution of the conditionals a program's costs sit in (``branches=`` arguments).

    Subclasses have ``num_devices``, ``conditionals`` and ``conditional_counts``.
    """

    num_devices: int
    conditionals: dict[str, str]
    conditional_counts: dict[str, int]
    conditional_branches: dict[str, int]

    def _matches(self, key: str) -> bool:
        """Whether ``key`` names one of this program's conditionals (a ``branches=`` key)."""
        return key in self.conditionals or any(key in op for op in self.conditionals.values())

    def _executions(self, name: str, value: Any) -> np.ndarray:
        """``int64[D, B]``: executions of each branch of conditional ``name`` on each device."""
        total = self.conditional_counts.get(name, 1)
        limit = self.conditional_branches.get(name)

        def check(b: int) -> None:
            if limit is not None and b >= limit:
                raise ValueError(
                    f"branches[{name!r}]: branch {b} does not exist; the conditional has "
                    f"{limit} branches (0..{limit - 1})"
                )

        if isinstance(value, Mapping):
            counts = {}
            for b, k in value.items():
                if not (isinstance(b, (int, np.integer)) and b >= 0):
                    raise ValueError(f"branches[{name!r}]: branch {b!r} is not an index >= 0")
                if not (isinstance(k, (int, np.integer)) and k >= 0):
                    raise ValueError(
                        f"branches[{name!r}][{b}] = {k!r}: executions must be an int >= 0"
                    )
                check(int(b))
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
        check(int(choice.max()))
        table = np.zeros((self.num_devices, int(choice.max()) + 1), np.int64)
        table[np.arange(self.num_devices), choice] = total
        return table

    def _parents(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Each conditional's enclosing ``(conditional, branch)`` path, outermost first, read
        from the paths of what runs inside it."""
        out: dict[str, tuple[tuple[str, int], ...]] = {}
        for thing in (*getattr(self, "ops", ()), *getattr(self, "items", ())):
            path = tuple(thing.branches)
            for i, (c, _) in enumerate(path):
                out.setdefault(c, path[:i])
        return out

    def _resolve(
        self, branches: Mapping[str, Any] | None, fallback: Mapping[str, int] | None = None
    ) -> dict[str, np.ndarray]:
        """Branch tables of every conditional. A key names the conditional whose op name
        holds it; among several, the outermost (a scope's conditional and those nested in
        its branches share the scope), then those inside branches that run. A conditional
        inside a branch that runs on no device needs no branch."""
        pending = dict(branches or {})
        ops, parents = self.conditionals, self._parents()
        out: dict[str, np.ndarray] = {}

        def runs(c: str) -> bool:
            return all(
                o not in out or (b < out[o].shape[1] and bool(out[o][:, b].any()))
                for o, b in parents.get(c, ())
            )

        def candidates(key: str) -> list[str]:
            if key in ops:
                return [key]
            names = [c for c, op in ops.items() if key in op]
            return [
                c
                for c in names
                if not any(o != c and ops[c].startswith(ops[o] + "/") for o in names)
            ]

        progress = True
        while pending and progress:
            progress = False
            for key, value in list(pending.items()):
                names = candidates(key)
                live = [c for c in names if runs(c)]
                if len(names) > 1 and len(live) == 1:
                    names = live
                if len(names) == 1:
                    out[names[0]] = self._executions(names[0], value)
                elif names and not live:
                    pass  # only inside branches that do not run: nothing to resolve
                else:
                    continue
                del pending[key]
                progress = True
        for key in pending:
            names = [c for c in candidates(key) if runs(c)]
            raise ValueError(
                f"branches key {key!r} must name exactly one of the program's "
                f"conditionals listed below (by HLO name or a part of its op name); it "
                f"matches {len(names)}. Conditionals: {self.conditionals}"
            )
        for c, branch in (fallback or {}).items():
            if c not in out:
                out[c] = self._executions(c, branch)
        for c in ops:
            if c not in out and not runs(c):
                out[c] = np.zeros((self.num_devices, self.conditional_branches.get(c, 1)), np.int64)
        missing = {c: op for c, op in ops.items() if c not in out}
        if missing:
            raise ValueError(
                "the program holds collectives inside conditionals, whose branch the program "
                f"alone cannot tell; pass branches={{name: branch index}} for {missing}"
            )
        return out

    def _runs(
        self,
        count: int,
        path: tuple[tuple[str, int], ...],
        taken: dict[str, np.ndarray],
        counted: set[str],
        name: str,
    ) -> np.ndarray:
        """``int64[D]``: executions on each device of something run ``count`` times per run
        of the program inside the conditionals ``path``: its count scaled, per conditional,
        by the share of that conditional's executions that take its branch."""
        if sum(c in counted for c, _ in path) > 1:
            raise ValueError(
                f"{name} sits in nested conditionals {[c for c, _ in path]}; give branch "
                "counts for at most one of them"
            )
        num = np.full(self.num_devices, count, np.int64)
        den = 1
        for cond, branch in path:
            table = taken[cond]
            num *= table[:, branch] if branch < table.shape[1] else 0
            den *= self.conditional_counts.get(cond, 1)
        if (num % den).any():
            raise ValueError(
                f"{name}: the branch counts of {[c for c, _ in path]} do not divide its "
                f"{count} executions per run evenly; give one branch per device instead"
            )
        return num // den

    @staticmethod
    def _counted(taken: dict[str, np.ndarray]) -> set[str]:
        """Conditionals given as branch counts (a share per branch rather than one branch)."""
        return {c for c, table in taken.items() if (table > 0).sum(1).max() > 1}


@dataclasses.dataclass(frozen=True)
class WireAudit(_Branches):
    """The collectives of a compiled program (see :func:`wire_audit`).

    Attributes:
      num_devices: devices (SPMD partitions) the program runs on; device ``d`` is mesh
        position ``d`` in row-major order.
      ops: every collective found.
      conditionals: ``{conditional name: JAX op name}`` of the conditionals that hold
        collectives (keys for ``branches=``).
      conditional_counts: ``{conditional name: executions per run}`` (the trip counts of the
        loops around it; 1 outside loops).
      conditional_branches: ``{conditional name: number of branches}``.
    """

    num_devices: int
    ops: tuple[CollectiveOp, ...]
    conditionals: dict[str, str]
    conditional_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    conditional_branches: dict[str, int] = dataclasses.field(default_factory=dict)

    def traffic(self, branches: Mapping[str, Any] | None = None) -> Traffic:
        """Per-device bytes sent, rounds and path bytes of one run of the program.

        Args:
          branches: for each conditional holding collectives, the branch index taken, as an
            int (every device, every execution) or ``int[D]`` (per device), or, when the
            conditional runs several times per run (inside a loop), ``{branch: executions}``
            summing to :attr:`conditional_counts` (every device). Keys are conditional names
            or a unique part of their op name (a ``jax.named_scope`` shows there); a part
            shared by a conditional and those nested in its branches names the outermost.
        """
        taken = self._resolve(branches)
        counted = self._counted(taken)
        d = self.num_devices
        sent = np.zeros(d, np.int64)
        rounds = np.zeros(d, np.int64)
        path = np.zeros(d, np.int64)
        for op in self.ops:
            runs = self._runs(op.count, op.branches, taken, counted, op.name)
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
    args: str = ""  # the text between the op's parentheses (e.g. a parameter's number)
    root: bool = False


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
    args = rest[om.end() : close - 1]
    operands = re.findall(r"%([\w.\-]+)", args)
    root = line.lstrip().startswith("ROOT ")
    return _Instr(m.group(1), shape, om.group(1), operands, rest[close:], args, root)


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
    m2 = _MESH_GROUPS_RE.match(attrs[i:])
    if m2:  # replica groups over a named mesh (XLA >= 0.12): mesh['d'=8] {'d'}
        return m2.group(0)
    if i < len(attrs) and attrs[i] == "[":  # iota replica groups: [2,4]<=[8] or ...T(1,0)
        m2 = re.match(r"\[[\d,]*\]<=\[[\d,]*\](T\([\d,]*\))?", attrs[i:])
        if m2:
            return m2.group(0)
    m2 = re.match(r"[^,\s}]+", attrs[i:])
    return m2.group(0) if m2 else None


_MESH_GROUPS_RE = re.compile(
    r"maximal_mesh\[device_id=(?P<device>\d+)\]\s*\{[^}]*\}"
    r"|mesh\[(?P<axes>[^\]]*)\](?:, device_ids=\((?P<ids>[^)]*)\))?\s*\{(?P<grouped>[^}]*)\}"
)


def _mesh_groups(text: str) -> list[list[int]]:
    """Replica groups written over a named mesh: ``mesh[a=2,b=4] {b}`` (every device with
    the same position on ``a`` forms a group, along ``b``), with ``, device_ids=(...)`` where
    the mesh's devices are not in order, and sub-axes ``b:(pre)size`` (the axis cut, major
    to minor, into ``[pre, size, rest]``; the group runs along ``size``)."""
    m = _MESH_GROUPS_RE.fullmatch(text)
    if m is None:
        raise ValueError(f"replica groups {text!r}: not a mesh the wire audit can read")
    if m["device"] is not None:
        return [[int(m["device"])]]
    names, sizes = [], []
    for axis in m["axes"].split(","):
        name, _, size = axis.strip().rpartition("=")
        names.append(name)
        sizes.append(int(size))
    ids = np.arange(math.prod(sizes))
    if m["ids"] is not None:
        ids = np.array([int(x) for x in re.findall(r"\d+", m["ids"])])
        if ids.size != math.prod(sizes):
            raise ValueError(f"replica groups {text!r}: {ids.size} device ids for a mesh of "
                             f"{math.prod(sizes)}")  # fmt: skip
    grouped: list[tuple[int, int, int]] = []  # (axis, pre, size)
    for ref in (r.strip() for r in m["grouped"].split(",") if r.strip()):
        sm = re.fullmatch(r"(.*):\((\d+)\)(\d+)", ref)
        name, pre, size = (sm.group(1), int(sm.group(2)), int(sm.group(3))) if sm else (ref, 1, 0)
        if name not in names:
            raise ValueError(f"replica groups {text!r}: no mesh axis {name!r}")
        a = names.index(name)
        grouped.append((a, pre, size or sizes[a]))
    # Cut every axis into the pieces the grouped sub-axes name (a piece is keyed by the
    # product of the sizes before it, major first, as a sub-axis's ``pre``), then move the
    # grouped pieces last, in the order given: each row is then one group.
    dims, where = [], {}
    for a, size in enumerate(sizes):
        bounds = sorted(
            {1, size} | {b for ax, pre, n in grouped if ax == a for b in (pre, pre * n)}
        )
        if len(bounds) == 1:  # an axis of size 1 (``'data'=1``): one piece of size 1
            bounds = [1, 1]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            where[(a, lo)] = len(dims)
            dims.append(hi // lo)
    order = [where[(a, pre)] for a, pre, _ in grouped]
    rest = [d for d in range(len(dims)) if d not in order]
    flat = ids.reshape(dims).transpose(rest + order)
    return flat.reshape(-1, math.prod(dims[d] for d in order) if order else 1).tolist()


def _groups(attrs: str, num_devices: int) -> list[list[int]]:
    text = _attr(attrs, "replica_groups")
    if text is None or text in ("{}", "{{}}"):
        return [list(range(num_devices))]
    if text.startswith(("mesh[", "maximal_mesh[")):
        return _mesh_groups(text)
    if text.startswith("["):
        m = re.match(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", text)
        assert m is not None
        out_shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    groups = [
        [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text)
    ]
    if not groups:  # a form this parser does not know: never count it as no traffic
        raise ValueError(f"replica groups {text!r}: a form the wire audit cannot read")
    return groups


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
        moving = [(s, t) for s, t in pairs if s != t]  # a device to itself is a local copy
        for src, _ in moving:
            sent[int(src)] += nbytes
        return sent, 1 if moving else 0
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


def _hlo_text(program: Any) -> str:
    if isinstance(program, jax.stages.Lowered):
        program = program.compile()
    if isinstance(program, jax.stages.Compiled):
        return program.as_text()
    if isinstance(program, str):
        return program
    raise TypeError(
        "program must be a jax.stages.Compiled, a jax.stages.Lowered or the text of an "
        f"optimized HLO module, got {type(program).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class _Visit:
    """One executed computation: how often it runs, under which branches, in which loop."""

    comp: str
    count: int
    branches: tuple[tuple[str, int], ...]
    loop: str | None  # the enclosing loop without a known trip count, if any


def _executed(
    comps: dict[str, list[_Instr]], entry: str
) -> tuple[list[_Visit], dict[str, str], dict[str, int], dict[str, int]]:
    """Every computation the program executes as a sequence of ops (the entry, loop bodies
    and conditions, conditional branches, called and async-wrapped computations), with its
    execution count; fused computations and reducers belong to the op that calls them.
    Also returns the conditionals' op names, execution counts and branch counts."""
    visits: list[_Visit] = []
    cond_names: dict[str, str] = {}
    cond_counts: dict[str, int] = {}
    cond_branches: dict[str, int] = {}

    def walk(comp: str, count: int, path: tuple, loop: str | None, seen: tuple) -> None:
        if comp in seen:
            return
        visits.append(_Visit(comp, count, path, loop))
        seen = seen + (comp,)
        for instr in comps.get(comp, []):
            if instr.opcode == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
                body = _comp_names(_attr(instr.attrs, "body"))
                cond = _comp_names(_attr(instr.attrs, "condition"))
                if m:
                    trips = int(m.group(1))
                    for c in body:
                        walk(c, count * trips, path, loop, seen)
                    for c in cond:
                        walk(c, count * (trips + 1), path, loop, seen)
                else:
                    label = f"{instr.name} ({_op_name(instr.attrs)!r})"
                    for c in body + cond:
                        walk(c, count, path, loop or label, seen)
            elif instr.opcode == "conditional":
                names = _comp_names(_attr(instr.attrs, "branch_computations"))
                if not names:  # true_computation / false_computation form: index 0 is true
                    names = _comp_names(_attr(instr.attrs, "true_computation")) + _comp_names(
                        _attr(instr.attrs, "false_computation")
                    )
                cond_names[instr.name] = _op_name(instr.attrs)
                cond_counts[instr.name] = cond_counts.get(instr.name, 0) + count
                cond_branches[instr.name] = len(names)
                for b, c in enumerate(names):
                    walk(c, count, path + ((instr.name, b),), loop, seen)
            elif instr.opcode in ("call", "async-start"):
                for c in _comp_names(_attr(instr.attrs, "calls") or _attr(instr.attrs, "to_apply")):
                    walk(c, count, path, loop, seen)
            # async-update / async-done: the wrapped computation ran at its async-start.

    walk(entry, 1, (), None, ())
    return visits, cond_names, cond_counts, cond_branches


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
    comps, entry, d = _computations(_hlo_text(program))
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    visits, cond_names, cond_counts, cond_branches = _executed(comps, entry)
    ops: list[CollectiveOp] = []
    conditionals: dict[str, str] = {}
    for visit in visits:
        for instr in comps.get(visit.comp, []):
            if instr.opcode not in _COLLECTIVES:
                continue
            if _COLLECTIVES[instr.opcode] is None:
                raise ValueError(
                    f"collective {instr.opcode} ({instr.name}, {_op_name(instr.attrs)!r}) "
                    "is not counted by the wire audit"
                )
            if visit.loop is not None:
                raise ValueError(
                    f"collective {instr.name} ({_op_name(instr.attrs)!r}) sits in the loop "
                    f"{visit.loop}, whose trip count XLA could not determine"
                )
            sent, rounds = _collective(instr, shapes, d)
            kind = _COLLECTIVES[instr.opcode]
            ops.append(
                CollectiveOp(
                    instr.name,
                    kind,
                    _op_name(instr.attrs),
                    visit.count,
                    visit.branches,
                    sent,
                    rounds,
                    instr.shape,
                )
            )
            for cond, _ in visit.branches:
                conditionals.setdefault(cond, cond_names[cond])
    return WireAudit(
        num_devices=d,
        ops=tuple(ops),
        conditionals=conditionals,
        conditional_counts={c: cond_counts[c] for c in conditionals},
        conditional_branches={c: cond_branches[c] for c in conditionals},
    )


# --------------------------------------------------------------------------- unlogged traffic


def unlogged_traffic(program: Any) -> tuple[CollectiveOp, ...]:
    """The collectives of a compiled program that no jaxcomm log accounts for.

    Every collective jaxcomm sends (and logs) runs inside the named scope
    :data:`jaxcomm.collectives.WIRE_SCOPE`, which the compiled program keeps in each op's
    metadata, through autodiff too. Any other collective is traffic that neither the logs nor
    the simulated clock see: most often the dense all-reduce autodiff adds when replicated
    parameters are differentiated inside ``shard_map`` (op name ``.../transpose(...)/
    psum_invariant``), or a ``lax.pmean`` of metrics in the step (see the blind spot below).

    Args:
      program: as for :func:`wire_audit` (compiled, lowered, or optimized HLO text).

    Returns:
      The unaccounted :class:`CollectiveOp` s (empty when every collective is jaxcomm's).
      Blind spot: XLA may combine independent all-reduces into one op that keeps one op's
      metadata, so a user's all-reduce merged into a jaxcomm ``psum`` (``reduce="psum"``)
      is not reported; autodiff's all-reduce of the gradient feeds the aggregator, so it
      cannot merge into the aggregator's own; tree collectives are permutes. The ring
      all-reduce is a reduce-scatter and an all-gather (permutes with ``hops=True``): on a
      GPU, XLA's combiners may merge a user's reduce-scatter or all-gather with those and
      keep the first op's metadata, hiding the user's bytes or flagging jaxcomm's (on the
      CPU nothing merges; ``hops=True`` avoids it).
    """
    from jaxcomm._src.collectives import WIRE_SCOPE

    return tuple(op for op in wire_audit(program).ops if WIRE_SCOPE not in op.op_name)


class UnloggedTrafficError(ValueError):
    """A compiled step holds collectives that no jaxcomm log accounts for."""


def _describe(op: CollectiveOp) -> str:
    per_run = int(op.sent.max()) * op.count if op.sent.size else 0
    where = f" inside conditional {op.branches[0][0]}" if op.branches else ""
    times = f" x{op.count} (loop)" if op.count > 1 else ""
    return (
        f"{op.kind} of {re.sub(r'{[^}]*}', '', op.shape)}{times}{where}: {per_run:,} bytes "
        "per device "
        f"per run, from {op.op_name!r}"
    )


def check_logged_traffic(program: Any, *, where: str = "the step") -> None:
    """Raise :class:`UnloggedTrafficError` when ``program`` holds a collective that no
    jaxcomm log accounts for (see :func:`unlogged_traffic`), listing each with its op,
    shape, bytes per device and the JAX operation it came from."""
    ops = unlogged_traffic(program)
    if not ops:
        return
    lines = "\n".join(f"  - {_describe(op)}" for op in ops)
    hint = ""
    if any("transpose(" in op.op_name and "psum" in op.op_name for op in ops):
        hint = (
            "\nAn all-reduce from transpose(...)/psum is autodiff summing a gradient over the "
            "mesh axis: the parameters entered jax.shard_map replicated and jax.grad ran "
            "inside. Differentiate with jaxcomm.worker_grad(loss_fn, axis_name) (or with "
            "respect to jaxcomm.varying(params, axis_name)) so that each worker keeps its own "
            "gradient for the aggregator."
        )
    raise UnloggedTrafficError(
        f"{where} sends {len(ops)} collective(s) that no jaxcomm log accounts for, so "
        f"neither the logged bytes nor the simulated time include them:\n{lines}{hint}"
    )


# --------------------------------------------------------------------------- compute cost

_TRANSCENDENTAL = frozenset(
    "exponential exponential-minus-one log log-plus-one tanh logistic sqrt rsqrt cbrt power "
    "sine cosine tan atan2 erf erf-inv".split()
)
# Ops that compute nothing (data movement, bookkeeping, control flow) and ops whose cost is
# handled elsewhere (fusions and calls by their computations, collectives by the wire audit).
_NO_FLOPS = frozenset(
    "parameter constant tuple get-tuple-element bitcast broadcast reshape transpose copy slice "
    "dynamic-slice dynamic-update-slice concatenate pad iota convert bitcast-convert gather "
    "reverse after-all partition-id replica-id rng-get-and-update-state rng-bit-generator "
    "copy-start copy-done opt-barrier optimization-barrier while conditional call fusion "
    "async-start async-update async-done domain add-dependency get-dimension-size "
    "collective-permute-done all-gather-done all-reduce-done send-done recv-done infeed "
    "outfeed".split()
) | frozenset(_COLLECTIVES)
# Top-level ops that touch no memory of their own.
_NO_MEMORY = frozenset(
    "parameter constant tuple get-tuple-element bitcast while conditional call after-all "
    "partition-id replica-id async-update async-done opt-barrier optimization-barrier domain "
    "add-dependency".split()
)


@dataclasses.dataclass(frozen=True)
class ComputeCost:
    """Per-device compute of one run of a program (one entry per device, partition order).

    Attributes:
      flops: ``float64[D]`` floating-point (and integer) operations; a multiply-add is 2.
      matmul_flops: ``float64[D]`` the part of ``flops`` in dots and convolutions.
      transcendentals: ``float64[D]`` exp, log, tanh, ... evaluations.
      hbm_bytes: ``float64[D]`` bytes the top-level ops read and write (a fusion counts its
        operands and result once; its internals stay in registers and caches).
    """

    flops: np.ndarray
    matmul_flops: np.ndarray
    transcendentals: np.ndarray
    hbm_bytes: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Cost:
    """Costs of one executed computation per execution."""

    comp: str
    count: int
    branches: tuple[tuple[str, int], ...]
    loop: str | None
    flops: float
    matmul_flops: float
    transcendentals: float
    hbm_bytes: float
    # Per op of the computation: its JAX op name and ``[flops, matmul, transcendentals,
    # bytes]``, for costs restricted to a part of the program (``per_device(select=...)``).
    op_names: tuple[str, ...] = ()
    op_costs: Any = None


@dataclasses.dataclass(frozen=True)
class ProgramCost(_Branches):
    """The compute cost of a compiled program (see :func:`program_cost`).

    Attributes:
      num_devices: devices (SPMD partitions) the program runs on.
      items: the executed computations with their costs per execution and counts.
      conditionals: ``{conditional name: JAX op name}`` of every conditional.
      conditional_counts: ``{conditional name: executions per run}``.
      conditional_branches: ``{conditional name: number of branches}``.
      uncounted: custom calls whose flops are unknown (their memory bytes are counted).
    """

    num_devices: int
    items: tuple[_Cost, ...]
    conditionals: dict[str, str]
    conditional_counts: dict[str, int]
    conditional_branches: dict[str, int]
    uncounted: tuple[str, ...]

    def per_device(
        self,
        branches: Mapping[str, Any] | None = None,
        *,
        select: Callable[[str], bool] | None = None,
    ) -> ComputeCost:
        """Per-device totals of one run.

        Args:
          branches: as :meth:`WireAudit.traffic`. A conditional left out counts its costliest
            branch (in flops) on every device: an upper bound.
          select: count only the ops whose JAX op name (the HLO metadata ``op_name``, e.g.
            ``"jit(step)/transpose(jvp(gpipe_tick))/dot_general"``; a fusion carries its
            root op's) makes ``select(name)`` true, e.g. the ops under a
            ``jax.named_scope``. The costliest branch of an unresolved conditional is
            chosen on the whole program, not on the selected part.

        Raises:
          ValueError: a computation with costs runs in a loop whose trip count XLA could
            not determine (named).
        """
        for item in self.items:
            if item.loop is not None and (item.flops or item.hbm_bytes):
                raise ValueError(
                    f"computation {item.comp} runs in the loop {item.loop}, whose trip count "
                    "XLA could not determine, so its cost is unknown"
                )
        fallback = {}
        for cond in self.conditionals:
            per_branch: dict[int, float] = {}
            for item in self.items:
                for c, b in item.branches:
                    if c == cond:
                        per_branch[b] = per_branch.get(b, 0.0) + item.count * item.flops
            fallback[cond] = max(per_branch, key=per_branch.get) if per_branch else 0
        taken = self._resolve(branches, fallback)
        counted = self._counted(taken)
        out = {k: np.zeros(self.num_devices) for k in ComputeCost.__dataclass_fields__}
        for item in self.items:
            runs = self._runs(item.count, item.branches, taken, counted, item.comp)
            if select is None:
                values = [getattr(item, k) for k in out]
            else:
                keep = np.array([bool(select(n)) for n in item.op_names], bool)
                values = item.op_costs[keep].sum(0) if keep.any() else np.zeros(4)
            for k, v in zip(out, values, strict=True):
                out[k] += runs * v
        return ComputeCost(**out)


def _instr_op_name(instr: _Instr, comps: dict[str, list[_Instr]]) -> str:
    """The JAX op name of ``instr``; a fusion without one (the CPU backend's library
    fusions) takes the first one inside it."""
    name = _op_name(instr.attrs)
    if name or instr.opcode != "fusion":
        return name
    for c in _comp_names(_attr(instr.attrs, "calls")):
        for inner in comps.get(c, []):
            name = _instr_op_name(inner, comps)
            if name:
                return name
    return ""


def _elements(shape: str) -> int:
    return sum(n for n, _ in _arrays(shape))


def _dims(shape: str) -> list[int]:
    m = _ARRAY_RE.search(shape)
    return [int(x) for x in m.group(2).split(",") if x] if m else []


def _instr_flops(
    instr: _Instr, shapes: dict[str, str], comps: dict[str, list[_Instr]], uncounted: list[str]
) -> tuple[float, float, float]:
    """``(flops, matmul flops, transcendentals)`` of one execution of ``instr``."""
    op = instr.opcode
    out = _elements(instr.shape)
    if op == "fusion":
        total = [0.0, 0.0, 0.0]
        for c in _comp_names(_attr(instr.attrs, "calls")):
            for inner in comps.get(c, []):
                for i, v in enumerate(_instr_flops(inner, shapes, comps, uncounted)):
                    total[i] += v
        return total[0], total[1], total[2]
    if op == "dot":
        lhs = _dims(shapes.get(instr.operands[0], ""))
        contract = [
            int(x) for x in re.findall(r"\d+", _attr(instr.attrs, "lhs_contracting_dims") or "")
        ]
        k = math.prod(lhs[i] for i in contract) if lhs else 1
        return 2.0 * out * k, 2.0 * out * k, 0.0
    if op == "convolution":
        return _conv_flops(instr, shapes, out)
    if op in ("reduce", "reduce-window", "scatter", "select-and-scatter", "sort", "map"):
        inputs = sum(_elements(shapes.get(o, "")) for o in instr.operands)
        if op == "reduce-window":
            window = [int(x) for x in re.findall(r"size=([\dx]+)", instr.attrs)[0].split("x")]
            return float(out * math.prod(window)), 0.0, 0.0
        if op == "sort":
            n = _elements(shapes.get(instr.operands[0], ""))
            return float(n * max(1.0, math.log2(max(n, 2)))), 0.0, 0.0
        return float(inputs), 0.0, 0.0
    if op == "custom-call":
        target = (_attr(instr.attrs, "custom_call_target") or "").strip('"')
        first = _first_array(instr.shape)  # the result; a library call adds a workspace
        if target in _GEMM_TARGETS:
            k = _gemm_contracted(instr, shapes)
            if k is not None:
                flops = 2.0 * _elements(first) * k
                return flops, flops, 0.0
        elif target in _CONV_TARGETS and len(instr.operands) >= 2:
            return _cudnn_conv_flops(instr, shapes, target, first)
        elif SAMPLE_TOPK_SCOPE in instr.attrs and instr.operands:
            # jaxcomm's sample selection on the CPU (a host kernel): about one comparison
            # per entry, in the same units as a reduce
            return float(_elements(shapes.get(instr.operands[0], ""))), 0.0, 0.0
        elif target == "TopK" and instr.operands:  # the CPU's lax.top_k: a partial sort
            n = _elements(shapes.get(instr.operands[0], ""))
            k = (_dims(first) or [1])[-1]
            return float(n * max(1.0, math.log2(max(k, 2)))), 0.0, 0.0
        uncounted.append(f"{instr.name} ({target})")
        return 0.0, 0.0, 0.0
    if op in _NO_FLOPS:
        return 0.0, 0.0, 0.0
    if op in _TRANSCENDENTAL:
        return 0.0, 0.0, float(out)
    return float(out), 0.0, 0.0  # elementwise arithmetic, compare, select, ...


# Library calls a GPU backend compiles dots and convolutions to (cuBLAS, cuBLASLt, cuDNN).
_GEMM_TARGETS = frozenset({"__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8"})
_CONV_TARGETS = frozenset(
    {"__cudnn$convForward", "__cudnn$convBackwardInput", "__cudnn$convBackwardFilter",
     "__cudnn$convBiasActivationForward"}
)  # fmt: skip


def _first_array(shape: str) -> str:
    """The first array of a (possibly tuple) HLO shape, e.g. ``f32[8,16]{1,0}``."""
    m = _ARRAY_RE.search(shape)
    return m.group(0) if m else ""


def _gemm_contracted(instr: _Instr, shapes: dict[str, str]) -> float | None:
    """``K`` of a cuBLAS gemm custom call: the product of the lhs contracting dimensions named
    in its ``backend_config`` (``gemm_backend_config.dot_dimension_numbers``)."""
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
    lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
    if m is None or not lhs:
        return None
    dims = [int(x) for x in re.findall(r"\d+", m.group(1))]
    if any(d >= len(lhs) for d in dims):
        return None
    return float(math.prod(lhs[d] for d in dims))


def _cudnn_conv_flops(
    instr: _Instr, shapes: dict[str, str], target: str, result: str
) -> tuple[float, float, float]:
    """Flops of a cuDNN convolution call: those of the forward convolution it belongs to,
    ``2 |forward output| |W| / W[o]``. The call's window and ``dim_labels`` describe that
    forward convolution; a forward call is ``(x, W) -> y``, a backward-input call
    ``(dy, W) -> dx`` and a backward-filter call ``(x, dy) -> dW``."""
    ops = [shapes.get(o, "") for o in instr.operands]
    if target == "__cudnn$convBackwardInput":
        out, kernel = _elements(ops[0]), _dims(ops[1])
    elif target == "__cudnn$convBackwardFilter":
        out, kernel = _elements(ops[1]), _dims(result)
    else:
        out, kernel = _elements(result), _dims(ops[1])
    labels = (_attr(instr.attrs, "dim_labels") or "").split("_")
    o = labels[1].find("o") if len(labels) > 1 else -1
    per_out = math.prod(kernel) / (kernel[o] if 0 <= o < len(kernel) else 1)
    flops = 2.0 * out * per_out
    return flops, flops, 0.0


def _conv_flops(instr: _Instr, shapes: dict[str, str], out: int) -> tuple[float, float, float]:
    """Flops of a convolution (or a cuDNN convolution call) with ``out`` result elements:
    ``2 out`` times the kernel elements per output feature."""
    kernel = _dims(shapes.get(instr.operands[1], ""))
    labels = (_attr(instr.attrs, "dim_labels") or "").split("_")
    o = labels[1].find("o") if len(labels) > 1 else -1
    per_out = math.prod(kernel) / (kernel[o] if o >= 0 and kernel else 1)
    # The kernel's input-feature dimension is already per group. A transposed (input
    # gradient) convolution dilates its input with zeros (``lhs_dilate``); products
    # with those zeros are not work, so the count is divided by the dilation.
    flops = 2.0 * out * per_out
    m = re.search(r"lhs_dilate=([\dx]+)", instr.attrs)
    if m:
        flops /= math.prod(int(x) for x in m.group(1).split("x"))
    return flops, flops, 0.0


_PASS_THROUGH = frozenset(
    "bitcast reshape convert copy negate abs exp log tanh logistic sqrt rsqrt add subtract "
    "multiply divide maximum minimum select compare and or xor not sign floor ceil "
    "round-nearest-even round-nearest-afz clamp power".split()
)


def _fusion_bytes(instr: _Instr, shapes: dict[str, str], comps: dict[str, list[_Instr]]) -> int:
    """Bytes a fusion reads and writes: each operand once, except operands of which only
    slices are used (directly, or through elementwise ops and reshapes that keep the element
    count: the slices' elements are read) and a buffer updated in place (only the update is
    written)."""
    inner = [i for c in _comp_names(_attr(instr.attrs, "calls")) for i in comps.get(c, [])]
    params = {int(i.args.strip() or 0): i.name for i in inner if i.opcode == "parameter"}
    users: dict[str, list[_Instr]] = {}
    for i in inner:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    inner_shapes = {i.name: i.shape for i in inner}
    needed: dict[str, float] = {}

    def elements_needed(name: str, total: int) -> float:
        # Elements of value ``name`` (``total`` of them) that the fusion's outputs depend on.
        if name in needed:
            return needed[name]
        needed[name] = total  # cycles cannot occur; this only guards repeated visits
        count = 0.0
        uses = users.get(name, [])
        for u in uses:
            if u.opcode in ("dynamic-slice", "slice", "gather"):
                # A slice reads its elements, or fewer when only slices of it are used.
                count += elements_needed(u.name, _elements(u.shape))
            elif u.opcode in _PASS_THROUGH and _elements(u.shape) == total:
                count += elements_needed(u.name, total)
            else:
                count = total
                break
        needed[name] = min(float(total), count) if uses else float(total)
        return needed[name]

    total = 0
    for idx, operand in enumerate(instr.operands):
        size = _nbytes(shapes.get(operand, ""))
        name = params.get(idx)
        uses = users.get(name, []) if name else []
        if uses and all(u.opcode == "dynamic-update-slice" and u.operands[0] == name for u in uses):
            size = 0  # the buffer is updated in place: only the update is written
        elif uses:
            n = _elements(inner_shapes.get(name, "") or shapes.get(operand, ""))
            if n:
                size = int(size * elements_needed(name, n) / n)
        total += size
    root = next((i for i in inner if i.root), None)
    if (
        root is not None
        and root.opcode == "dynamic-update-slice"
        and root.operands[0] in set(params.values())
    ):
        return total + _nbytes(shapes.get(root.operands[1], ""))
    return total + _nbytes(instr.shape)


def _instr_bytes(instr: _Instr, shapes: dict[str, str], comps: dict[str, list[_Instr]]) -> int:
    """Bytes a top-level op reads and writes."""
    op = instr.opcode
    if op in _NO_MEMORY:
        return 0
    if op == "fusion":
        return _fusion_bytes(instr, shapes, comps)
    if op == "dynamic-update-slice":  # in place
        return 2 * _nbytes(shapes.get(instr.operands[1], ""))
    if op in ("dynamic-slice", "slice"):
        return 2 * _nbytes(instr.shape)
    return sum(_nbytes(shapes.get(o, "")) for o in instr.operands) + _nbytes(instr.shape)


def program_cost(program: Any) -> ProgramCost:
    """The compute cost of a compiled program, read from its optimized HLO.

    Every executed computation (entry, loop bodies and conditions, conditional branches)
    is costed once and multiplied by the trip counts of the loops around it, which XLA
    records on each ``while`` (``known_trip_count``); XLA's own ``cost_analysis()`` counts a
    loop body once. Flops: ``2 * M * N * K`` per dot (and the analogue per convolution),
    one per element for elementwise arithmetic, one per input element for reductions,
    transcendentals apart; data movement costs none. Memory: each top-level op reads its
    operands and writes its result once (a fusion's internals stay on chip; slices read only
    the slice; in-place updates write only the update). This is the per-device program of
    an SPMD computation, so it is what each device runs.

    Args:
      program: as :func:`wire_audit`; read the same compiled program for both.

    Returns:
      A :class:`ProgramCost`; ``.per_device(branches)`` gives per-device totals.
    """
    comps, entry, d = _computations(_hlo_text(program))
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    visits, cond_names, cond_counts, cond_branches = _executed(comps, entry)
    items, uncounted = [], []
    for visit in visits:
        names, rows = [], []
        for instr in comps.get(visit.comp, []):
            f, mm, t = _instr_flops(instr, shapes, comps, uncounted)
            mem = _instr_bytes(instr, shapes, comps)
            if f or t or mem:
                names.append(_instr_op_name(instr, comps))
                rows.append((f, mm, t, mem))
        costs = np.asarray(rows, np.float64).reshape(-1, 4)
        flops, matmul, trans, mem = (float(x) for x in costs.sum(0))
        items.append(
            _Cost(
                visit.comp,
                visit.count,
                visit.branches,
                visit.loop,
                flops,
                matmul,
                trans,
                mem,
                tuple(names),
                costs,
            )
        )
    return ProgramCost(
        num_devices=d,
        items=tuple(items),
        conditionals=cond_names,
        conditional_counts=cond_counts,
        conditional_branches=cond_branches,
        uncounted=tuple(uncounted),
    )
