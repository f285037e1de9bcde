"""litevlm.dist: sharding, gathering in order, DDP and the resumable store, on two real gloo processes."""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from litevlm.dist import Dist, ShardStore, all_reduce_mean, close, ddp, end_rank, gather, init_dist, joined, shard
from litevlm.errors import LiteVLMError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a two-process job, set up the way torchrun sets one up (its environment variables)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    d = init_dist("cpu")
    assert init_dist("cpu") == d  # a second call joins nothing new
    items = list(range(7))
    mine = shard(items, d)
    squares = gather([{"item": x, "rank": d.rank, "square": x * x} for x in mine], d)
    mean_rank = all_reduce_mean(float(d.rank), d)

    # DDP: each rank sees different data; after backward both hold the mean gradient
    torch.manual_seed(0)
    model = ddp(torch.nn.Linear(3, 1, bias=False), d)
    x = torch.full((2, 3), float(d.rank + 1))
    model(x).sum().backward()
    grads = gather([model.module.weight.grad.tolist()], d)

    store = ShardStore(out, "job", d, meta={"n": 7})
    for x in mine:
        if x != 5:  # leave one item unfinished: a rerun has to do it
            store.put(str(x), x * x)
    merged = store.merge()
    if d.is_main:
        result = {"mine": mine, "squares": squares, "mean_rank": mean_rank, "grads": grads, "merged": merged}
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    else:
        assert squares is None and merged is None
    close(d)
    assert joined()
    end_rank(0)  # as `litevlm` ends a torchrun rank


def test_two_gloo_ranks_shard_gather_ddp_and_store(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["mine"] == [0, 2, 4, 6]  # rank 0 takes items 0, W, 2W, ...
    assert [r["item"] for r in result["squares"]] == list(range(7))  # back in the original order
    assert [r["rank"] for r in result["squares"]] == [0, 1, 0, 1, 0, 1, 0]  # and really computed on both ranks
    assert result["mean_rank"] == 0.5
    # d(sum(W x))/dW = sum over the batch of x: rank 0 gives 2*1, rank 1 gives 2*2; DDP's mean is 3 (exact in fp32)
    assert result["grads"] == [[[3.0, 3.0, 3.0]], [[3.0, 3.0, 3.0]]]
    assert result["merged"] == {str(x): x * x for x in range(7) if x != 5}
    assert sorted(p.name for p in tmp_path.glob("job.*.json")) == ["job.rank0-of2.json", "job.rank1-of2.json"]

    # a rerun on one process sees every finished item, whichever rank of the two-rank run did it
    store = ShardStore(tmp_path, "job", Dist(), meta={"n": 7})
    todo = [x for x in range(7) if str(x) not in store.done()]
    assert todo == [5]


def test_world_of_one_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    d = init_dist()
    assert (d.rank, d.world_size, d.is_main) == (0, 1, True)
    items = ["a", "b", "c"]
    assert shard(items, d) == items and gather(items, d) == items
    module = torch.nn.Linear(2, 2)
    assert ddp(module, d) is module
    assert all_reduce_mean(2.5, d) == 2.5
    close(d)
    assert not joined()  # a world of one ends as any process does


def test_a_rank_of_the_cli_ends_at_once_with_its_exit_code(monkeypatch, capsys):
    """Under torchrun `litevlm` leaves by `end_rank` once its work is done, with the code it would have returned."""
    import litevlm.dist
    from litevlm.cli import main

    ended = []

    def fake_exit(code):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(litevlm.dist, "_joined", True)
    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        main(["ask", "--model", "no-such-model", "--images", "/nonexistent", "--question", "Is it safe?"])
    assert ended == [2] and "image folder not found: /nonexistent" in capsys.readouterr().err


def test_shard_covers_every_item_once():
    items = list(range(11))
    shares = [shard(items, Dist(rank=r, world_size=3)) for r in range(3)]
    assert sorted(sum(shares, [])) == items
    assert [len(s) for s in shares] == [4, 4, 3]


def test_bad_environment_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(LiteVLMError, match="WORLD_SIZE"):
        init_dist()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(LiteVLMError, match="RANK=2"):
        init_dist()


def test_store_refuses_another_configuration_and_a_broken_file(tmp_path):
    store = ShardStore(tmp_path, "job", Dist(), meta={"model": "a"})
    store.put("0", {"answer": "yes"})
    assert ShardStore(tmp_path, "job", Dist(), meta={"model": "a"}).done() == {"0": {"answer": "yes"}}
    with pytest.raises(LiteVLMError, match="another configuration"):
        ShardStore(tmp_path, "job", Dist(), meta={"model": "b"})
    (tmp_path / "job.rank1-of2.json").write_text("{not json")
    with pytest.raises(LiteVLMError, match="job.rank1-of2.json"):
        store.done()
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write leaves no temporary file behind


def test_store_rewrites_its_file_at_most_every_flush_interval(tmp_path):
    store = ShardStore(tmp_path, "job", Dist(), flush_every_s=3600.0)
    store.put("0", 0)  # nothing written yet: written now
    store.put("1", 1)  # written a moment ago: kept in memory
    on_disk = lambda: json.loads((tmp_path / "job.rank0-of1.json").read_text())["results"]  # noqa: E731
    assert on_disk() == {"0": 0}
    store.flush()
    assert on_disk() == {"0": 0, "1": 1}
