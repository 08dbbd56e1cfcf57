"""Loading a checkpoint folder into a live state, in place, with resharding.

Loading is planned first (structure, shapes, dtypes, which byte ranges of which files each
tensor needs), then the files the plan touches are verified against the manifest, and only
then is the state modified, so a corrupt or mismatched checkpoint never half-loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from prime_ckpt.errors import CorruptCheckpoint, NotCovered, StateMismatch
from prime_ckpt.manifest import Manifest, data_name, meta_name, read_manifest
from prime_ckpt.state import (
    dtype_from_name,
    dtype_name,
    ext_index,
    is_dtensor,
    key_str,
    shard_rows,
    unpack_meta,
)


@dataclass
class CheckpointSource:
    """A committed checkpoint folder opened for reading: a whole disk checkpoint, or one
    rank's RAM slot. `CheckpointSource.open("disk", folder / step_dirname(step))`."""

    tier: str
    dir: Path
    manifest: Manifest
    ranks: list[int]
    _metas: dict[int, dict] = field(default_factory=dict)
    _verified: set[str] = field(default_factory=set)

    @classmethod
    def open(cls, tier: str, path: Path) -> CheckpointSource:
        """Read the manifest of the folder `path`; `tier` ("ram", "disk") labels where it is.
        CorruptCheckpoint if the manifest is missing or fails its own checksum."""
        try:
            m = read_manifest(path)
        except Exception as e:
            raise CorruptCheckpoint(str(e)) from None
        ranks = [int(m.extra["rank"])] if "rank" in m.extra else list(range(m.world_size))
        return cls(tier, path, m, ranks)

    def verify(self, name: str) -> None:
        """Check one file's size and hash against the manifest (once); CorruptCheckpoint
        if it is missing or differs."""
        if name in self._verified:
            return
        entry = self.manifest.files.get(name)
        p = self.dir / name
        if entry is None:
            raise CorruptCheckpoint(f"{p}: not listed in the manifest")
        problem = self.manifest.file_problem(name, p)
        if problem:
            raise CorruptCheckpoint(problem)
        self._verified.add(name)

    def meta(self, rank: int) -> dict:
        """One rank's verified metadata: the state's structure and its tensor records."""
        if rank not in self._metas:
            self.verify(meta_name(rank))
            try:
                self._metas[rank] = unpack_meta((self.dir / meta_name(rank)).read_bytes())
            except Exception as e:
                raise CorruptCheckpoint(f"{self.dir / meta_name(rank)}: unreadable: {e}") from None
        return self._metas[rank]

    def shards(self, path: tuple) -> list[tuple[int, list]]:
        """Every (rank, record) written for a DTensor key, across the ranks of this source."""
        out = []
        for r in self.ranks:
            for rec in self.meta(r)["tensors"]:
                if rec[7] and tuple(rec[0]) == path:
                    out.append((r, rec))
        return out


@dataclass
class _Read:
    file: str  # data file name in the source folder
    offset: int
    nbytes: int
    dst: torch.Tensor  # a (view of a) target tensor
    dtype: torch.dtype
    shape: list[int]


@dataclass
class Plan:
    source: CheckpointSource
    reads: list[_Read] = field(default_factory=list)
    sets: list[tuple[Any, Any, Any]] = field(default_factory=list)  # (container, key, value)

    def files(self) -> set[str]:
        return {r.file for r in self.reads}


Source = CheckpointSource  # the former name, still importable from prime_ckpt.reader


def _target_rows(t: torch.Tensor) -> tuple[torch.Tensor, list[int], int]:
    """(local tensor, global shape, dim-0 offset) that `t` wants filled."""
    if is_dtensor(t):
        try:
            local, gshape, row, _ = shard_rows(t)
        except ValueError as e:
            raise StateMismatch(str(e)) from None
        return local, gshape, row
    return t, list(t.shape), 0


class _Planner:
    def __init__(self, source: CheckpointSource, rank: int, world: int, strict: bool) -> None:
        self.src = source
        self.strict = strict
        same = source.manifest.world_size == world and rank in source.ranks
        if not same and 0 not in source.ranks:
            raise NotCovered(f"{source.dir} holds rank {source.ranks} of another world size")
        # rank-local values come from the same rank when the world size is unchanged, else
        # from rank 0 (they are assumed replicated, like step counters and hyperparameters)
        self.rank = rank if same else 0
        self.meta = source.meta(self.rank)
        self.plan = Plan(source)
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.wrong: list[str] = []

    def run(self, state: dict) -> Plan:
        self._walk(state, self.meta["skeleton"], ())
        problems = []
        if self.missing:
            problems.append(
                "missing keys (in the state, not in the checkpoint): " + _few(self.missing)
            )
        if self.unexpected:
            problems.append(
                "unexpected keys (in the checkpoint, not in the state): " + _few(self.unexpected)
            )
        problems += self.wrong
        hint = "" if self.wrong else " (or pass strict=False to load only the keys that match)"
        if problems:
            raise StateMismatch(
                f"checkpoint step {self.src.manifest.step} ({self.src.dir}) does not match the "
                "state: " + "; ".join(problems) + hint
            )
        return self.plan

    def _walk(self, target: Any, saved: Any, path: tuple) -> Any:
        idx = ext_index(saved)
        if idx is not None:
            if not isinstance(target, torch.Tensor):
                self.wrong.append(
                    f"{key_str(path)}: checkpoint has a tensor, state has {type(target).__name__}"
                )
                return target
            self.plan_tensor(target, self.meta["tensors"][idx], path)
            return target
        if isinstance(saved, dict):
            if not isinstance(target, dict):
                self.wrong.append(
                    f"{key_str(path)}: checkpoint has a dict, state has {type(target).__name__}"
                )
                return target
            for k in target:
                if k not in saved and self.strict:
                    self.missing.append(key_str((*path, k)))
            for k, v in saved.items():
                if k in target:
                    new = self._walk(target[k], v, (*path, k))
                    if new is not target[k]:
                        self.plan.sets.append((target, k, new))
                elif self.strict:
                    self.unexpected.append(key_str((*path, k)))
                else:
                    self.plan.sets.append((target, k, self._materialize(v, (*path, k))))
            return target
        if isinstance(saved, list) and isinstance(target, (list, tuple)):
            if not _holds_tensors(saved) and not _holds_tensors(target):
                # a list of plain values is one value: replaced whole, whatever its length
                value = self._materialize(saved, path)
                return tuple(value) if isinstance(target, tuple) else value
            n = min(len(saved), len(target))
            if self.strict:
                self.missing += [key_str((*path, i)) for i in range(len(saved), len(target))]
                self.unexpected += [key_str((*path, i)) for i in range(len(target), len(saved))]
            elems = [self._walk(target[i], saved[i], (*path, i)) for i in range(n)]
            if isinstance(target, tuple):
                new = tuple(elems) + tuple(target[n:])
                return (
                    target
                    if all(a is b for a, b in zip(new, target, strict=False))
                    and len(new) == len(target)
                    else new
                )
            for i in range(n):
                if elems[i] is not target[i]:
                    self.plan.sets.append((target, i, elems[i]))
            if not self.strict:
                for i in range(len(target), len(saved)):
                    self.plan.sets.append((target, None, self._materialize(saved[i], (*path, i))))
            return target
        if isinstance(target, (dict, list, torch.Tensor)):
            self.wrong.append(
                f"{key_str(path)}: checkpoint has {type(saved).__name__}, state has {type(target).__name__}"
            )
            return target
        return self._materialize(saved, path)

    def _materialize(self, saved: Any, path: tuple) -> Any:
        """A new value for a key the state lacks (non-strict loading)."""
        idx = ext_index(saved)
        if idx is not None:
            rec = self.meta["tensors"][idx]
            t = torch.empty(rec[3] or rec[2], dtype=dtype_from_name(rec[1]))
            self.plan_tensor(t, rec, path)
            return t
        if isinstance(saved, dict):
            return {k: self._materialize(v, (*path, k)) for k, v in saved.items()}
        if isinstance(saved, list):
            return [self._materialize(v, (*path, i)) for i, v in enumerate(saved)]
        return saved

    def plan_tensor(self, target: torch.Tensor, rec: list, path: tuple) -> None:
        """Plan the reads that fill `target` (its local rows) from the saved record `rec`;
        a shape or dtype mismatch is noted in `wrong`, missing rows raise NotCovered."""
        local, gshape, row0 = _target_rows(target)
        saved_shape = rec[3] if rec[3] is not None else rec[2]
        dt = dtype_from_name(rec[1])
        if list(gshape) != list(saved_shape) or target.dtype != dt:
            self.wrong.append(
                f"{key_str(path)}: checkpoint has shape {tuple(saved_shape)} {rec[1]}, state has "
                f"{tuple(gshape)} {dtype_name(target.dtype)}"
            )
            return
        if rec[3] is None:  # a plain tensor: one shard holding everything
            shards = [(self.rank, rec)]
        else:
            shards = self.src.shards(path)
        if local.dim() == 0 or not gshape:
            shards = [s for s in shards if s[1][6]] or shards
            r, s = shards[0]
            self.plan.reads.append(_Read(data_name(r), s[5], s[6], local, dt, []))
            return
        lo, hi = row0, row0 + local.shape[0]
        row_bytes = math.prod(saved_shape[1:]) * torch.empty(0, dtype=dt).element_size()
        covered = 0
        seen: set[int] = set()
        for r, s in sorted(shards, key=lambda x: x[1][4]):
            a, b = s[4], s[4] + (s[2][0] if s[2] else 0)
            if a in seen or b <= lo or a >= hi:
                continue
            seen.add(a)
            x, y = max(a, lo), min(b, hi)
            self.plan.reads.append(
                _Read(
                    data_name(r),
                    s[5] + (x - a) * row_bytes,
                    (y - x) * row_bytes,
                    local[x - lo : y - lo],
                    dt,
                    [y - x, *saved_shape[1:]],
                )
            )
            covered += y - x
        if covered != hi - lo:
            raise NotCovered(
                f"{key_str(path)}: rows {lo}..{hi} of {tuple(saved_shape)} are not all in "
                f"{self.src.dir} (ranks {self.src.ranks})"
            )


def _holds_tensors(node: Any) -> bool:
    if isinstance(node, torch.Tensor) or ext_index(node) is not None:
        return True
    if isinstance(node, dict):
        return any(_holds_tensors(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_tensors(v) for v in node)
    return False


def _few(keys: list[str], n: int = 8) -> str:
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def plan_load(state: dict, source: CheckpointSource, rank: int, world: int, strict: bool) -> Plan:
    """Check `state` against `source` and verify every file the load will read."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    plan = _Planner(source, rank, world, strict).run(state)
    for f in sorted(plan.files()):
        source.verify(f)
    return plan


def apply_plan(plan: Plan) -> None:
    """Copy the planned bytes into the state and replace its plain values."""
    by_file: dict[str, list[_Read]] = {}
    for r in plan.reads:
        by_file.setdefault(r.file, []).append(r)
    with torch.no_grad():
        for name, reads in by_file.items():
            with open(plan.source.dir / name, "rb") as f:
                for r in sorted(reads, key=lambda r: r.offset):
                    if r.nbytes:
                        f.seek(r.offset)
                        _fill(f, r, plan.source.dir / name)
    for container, key, value in plan.sets:
        if key is None:
            container.append(value)
        else:
            container[key] = value


READ_BLOCK = 16 << 20  # bytes: the most a load holds besides the state (a tensor's rows)


def _fill(f: BinaryIO, r: _Read, where: Path) -> None:
    """`r`'s bytes from `f` into its target: in place when that is a contiguous CPU tensor,
    else (a GPU, a strided view) a block of rows at a time, so a load never holds a copy of
    a whole tensor (an embedding is a third of a small model)."""
    dst = r.dst
    if r.nbytes > READ_BLOCK and r.shape and dst.device.type == "cpu" and dst.is_contiguous():
        _read_exact(f, dst.detach().view(-1).view(torch.uint8), where)
        return
    rows = r.shape[0] if r.shape else 1
    per_row = r.nbytes // rows
    step = max(1, READ_BLOCK // max(per_row, 1))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        buf = torch.empty((b - a) * per_row, dtype=torch.uint8)
        _read_exact(f, buf, where)
        block = buf.view(r.dtype)
        if r.shape:
            dst[a:b].copy_(block.view([b - a, *r.shape[1:]]))
        else:
            dst.copy_(block.view(r.shape))


def _read_exact(f: BinaryIO, into: torch.Tensor, where: Path) -> None:
    """Fill the uint8 tensor `into` from `f`; CorruptCheckpoint when the file ends first."""
    if f.readinto(into.numpy()) != into.numel():
        raise CorruptCheckpoint(f"{where}: short read")


def tensor_paths(
    source: CheckpointSource, under: tuple = ()
) -> list[tuple[tuple, list[int], torch.dtype]]:
    """(key path, whole shape, dtype) of every tensor saved under the key path `under`."""
    out = []
    for rec in source.meta(source.ranks[0])["tensors"]:
        path = tuple(rec[0])
        if path[: len(under)] == under:
            shape = rec[3] if rec[3] is not None else rec[2]
            out.append((path, list(shape), dtype_from_name(rec[1])))
    return out


def read_tensor(source: CheckpointSource, path: tuple) -> torch.Tensor:
    """One whole tensor of a checkpoint, its shards of every rank assembled, verified first.

    Reading tensor by tensor keeps memory bounded by the largest tensor, however large the
    checkpoint (used to export weights)."""
    planner = _Planner(source, rank=0, world=1, strict=True)
    rec = next((r for r in planner.meta["tensors"] if tuple(r[0]) == tuple(path)), None)
    if rec is None:
        raise StateMismatch(f"{key_str(path)}: no such tensor in {source.dir}")
    t = torch.empty(rec[3] if rec[3] is not None else rec[2], dtype=dtype_from_name(rec[1]))
    planner.plan_tensor(t, rec, tuple(path))
    for f in sorted(planner.plan.files()):
        source.verify(f)
    apply_plan(planner.plan)
    return t
