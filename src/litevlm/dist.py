"""Data-parallel plumbing for jobs started by `torchrun`: one process per rank, PyTorch's process groups.

`torchrun --nproc-per-node W -m litevlm ...` starts W copies of a command with RANK, WORLD_SIZE and
LOCAL_RANK set; `init_dist` joins them into one process group (gloo on CPU, NCCL on GPU). A job then
takes its share of the items with `shard` (rank r gets items r, r+W, r+2W, ...), does its work, and
`gather` brings every rank's results back to rank 0 in the items' original order. Without torchrun the
same code runs as a world of one: no process group, `shard` and `gather` hand the list back unchanged.

`ShardStore` makes such a job resumable: each rank keeps its finished results in its own JSON file,
written atomically, so a rerun (with any world size) skips the items some rank already finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from litevlm.errors import LiteVLMError

_joined = False  # this process joined a process group of several ranks (it ends by `end_rank`)


@dataclass(frozen=True)
class Dist:
    """Where this process stands in the job: its rank among world_size, its rank on this node, its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, scores and writes; the other ranks only compute."""
        return self.rank == 0


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LiteVLMError(f"{name}={value!r} is not an integer: start the job with torchrun, which sets it") from None


def init_dist(device: str = "cpu") -> Dist:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK); a world of one without it.

    device "cpu" uses gloo; "cuda" uses NCCL with rank r on GPU LOCAL_RANK of its node. Calling it again
    in the same process returns the same Dist and does not create a second group.
    """
    world = _env_int("WORLD_SIZE") or 1
    rank = _env_int("RANK") or 0
    local_rank = _env_int("LOCAL_RANK")
    local_rank = rank if local_rank is None else local_rank
    if world < 1 or not 0 <= rank < world:
        raise LiteVLMError(f"RANK={rank} does not lie in WORLD_SIZE={world}: start the job with torchrun")
    cuda = device.startswith("cuda")
    if cuda and world > 1:
        if not torch.cuda.is_available():
            raise LiteVLMError(f"device {device!r} asked for under torchrun, but CUDA is not available here")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
    d = Dist(rank=rank, world_size=world, local_rank=local_rank, device=device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    if world > 1:
        global _joined
        _joined = True
    if world > 1 and (dist.get_rank(), dist.get_world_size()) != (rank, world):
        raise LiteVLMError(
            f"a process group of rank {dist.get_rank()} / {dist.get_world_size()} already exists, "
            f"but the environment says {rank} / {world}"
        )
    return d


def shard(items: list, d: Dist) -> list:
    """Rank r's share of `items`: items r, r+W, r+2W, ... (W = world size), so shares differ by one at most."""
    return list(items[d.rank :: d.world_size])


def gather(objs: list, d: Dist) -> list | None:
    """Every rank's `shard` results, on rank 0, back in the order of the list that was sharded; None elsewhere.

    objs must be this rank's results for `shard(items, d)`, one per item, in that order, and picklable.
    E.g. W = 2, items [a, b, c]: rank 0 holds [A, C], rank 1 [B] -> rank 0 gets [A, B, C].
    """
    if d.world_size == 1:
        return list(objs)
    parts = [None] * d.world_size if d.is_main else None
    dist.gather_object(list(objs), parts, dst=0)
    if not d.is_main:
        return None
    out = [None] * sum(len(p) for p in parts)
    for r, part in enumerate(parts):
        out[r :: d.world_size] = part  # rank r's i-th result was item r + i*W
    return out


def barrier(d: Dist) -> None:
    """Wait until every rank gets here."""
    if d.world_size > 1:
        dist.barrier()


def all_reduce_mean(value: torch.Tensor | float, d: Dist) -> torch.Tensor | float:
    """The mean of `value` over the ranks, on every rank (a float in, a float out)."""
    if d.world_size == 1:
        return value
    is_float = not isinstance(value, torch.Tensor)
    t = torch.tensor(float(value), dtype=torch.float64) if is_float else value.detach().clone()
    if d.device.startswith("cuda"):
        t = t.to(d.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t = t / d.world_size
    return t.item() if is_float else t


def ddp(module: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """`module` wrapped in DistributedDataParallel when the world has several ranks; `module` itself otherwise.

    DDP averages gradients over the ranks during backward, so each rank's optimiser takes the same step.
    The wrapped module's own attributes are at `.module`.
    """
    if d.world_size == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [d.local_rank] if d.device.startswith("cuda") else None
    return DistributedDataParallel(module, device_ids=device_ids)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module `ddp` wrapped (to save it, or to read its attributes); `module` itself when unwrapped."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def close(d: Dist, *, synced: bool = True) -> None:
    """Leave the process group (at the end of a job; harmless in a world of one).

    `synced`: wait first until every rank is here, so that no rank tears its connections down while a peer is
    still finishing a collective with it (gloo aborts the peer then); a job that failed skips the wait, since the
    other ranks may never come."""
    if d.world_size > 1 and dist.is_initialized():
        if synced:
            dist.barrier()
        dist.destroy_process_group()


def joined() -> bool:
    """Whether this process took part in a job of several ranks (its group may be closed by now)."""
    return _joined


def end_rank(code: int = 0) -> None:
    """End a rank's process now, its output flushed, skipping the interpreter's teardown: gloo's threads outlive
    `destroy_process_group`, and a few exits in a hundred tore them down in the wrong order and aborted the finished
    process (SIGABRT, "terminate called without an active exception"), which torchrun reports as a failed job.
    Call it last, after `close`: nothing after it runs, atexit handlers included."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)


class ShardStore:
    """One rank's finished results of a named job, kept in `folder/name.rank{r}-of{W}.json`, so a rerun resumes.

    Results are keyed by a string naming the item (its index, its id). `done()` reads every rank's file of
    the job, whatever world size wrote it, so a rerun on a different number of ranks still skips finished
    items. The file is rewritten whole, through a temporary file and a rename, so a job killed mid-write
    leaves the previous file intact; `put` rewrites it when the last write is `flush_every_s` old (a killed
    job loses at most that much work, and a long job does not rewrite a large file per item), `flush` and
    `merge` always. `meta` describes the job (its configuration); files written with a different meta are
    refused rather than mixed in.
    """

    def __init__(self, folder: str | Path, name: str, d: Dist, meta: dict | None = None, flush_every_s: float = 10.0):
        self.folder = Path(folder)
        self.name = name
        self.d = d
        self.meta = meta or {}
        self.flush_every_s = flush_every_s
        self.written = float("-inf")  # time.monotonic() of the last write
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"{name}.rank{d.rank}-of{d.world_size}.json"
        self.results: dict[str, object] = {}
        own = self._read(self.path) if self.path.exists() else {}
        self.results.update(own)

    def _read(self, path: Path) -> dict:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LiteVLMError(f"{path} is not a readable results file ({e}): delete it to redo its items") from e
        if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
            raise LiteVLMError(f"{path} is not a results file of litevlm: delete it to redo its items")
        if data.get("meta", {}) != self.meta:
            raise LiteVLMError(
                f"{path} holds results of another configuration ({data.get('meta')}), not {self.meta}: "
                "use another folder, or delete it"
            )
        return data["results"]

    def files(self) -> list[Path]:
        """Every rank's file of this job in the folder, any world size."""
        return sorted(self.folder.glob(f"{self.name}.rank*-of*.json"))

    def done(self) -> dict[str, object]:
        """Every finished result of this job in the folder (all ranks' files), keyed by item."""
        merged: dict[str, object] = {}
        for path in self.files():
            merged.update(self._read(path))
        merged.update(self.results)
        return merged

    def put(self, key: str, result) -> None:
        """Record one finished item (JSON-serialisable); the file is rewritten if its last write is old enough."""
        self.results[str(key)] = result
        if time.monotonic() - self.written >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Rewrite this rank's file with every result recorded, atomically."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "results": self.results}))
        os.replace(tmp, self.path)
        self.written = time.monotonic()

    def merge(self) -> dict[str, object] | None:
        """On rank 0, after every rank finished (a barrier): all results of the job; None on other ranks."""
        self.flush()
        barrier(self.d)
        return self.done() if self.d.is_main else None
