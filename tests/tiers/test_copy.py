"""The copy engines and the byte mapping they share. Every engine test runs on the CPU engine,
on the CUDA engine over the fake CUDA layer (`tests/helpers/fake_cuda.py`; its shard pinned,
and pageable) and, on a machine with CUDA (marker `gpu`), on the CUDA engine."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers.fake_cuda import FakeCuda  # noqa: E402
from tiering.errors import StateError  # noqa: E402
from tiers.copy import (  # noqa: E402
    CpuCopyEngine,
    Direction,
    EngineBlocks,
    GroupRef,
    KVTensor,
    plan_copy,
)
from tiers.copy.base import CopyEngine, CopyJob, CopyResult  # noqa: E402
from tiers.region import PrimaryRegion, RegionLayout  # noqa: E402


@dataclass
class Setup:
    """A fake engine KV cache (padded rows, several groups) and a worker shard."""

    tensors: list[KVTensor]
    groups: list[list[GroupRef]]
    shard: torch.Tensor
    bpc: int
    offsets: list[int]
    fake: FakeCuda | None = None

    def engine(self, **kw: object) -> CopyEngine:
        if self.fake is not None:
            from tiers.copy.cuda import CudaCopyEngine

            return CudaCopyEngine(
                self.tensors, self.groups, self.shard, self.bpc, cuda=self.fake, **kw
            )  # type: ignore[arg-type]
        if self.tensors[0].tensor.is_cuda:
            from tiers.copy.cuda import CudaCopyEngine

            return CudaCopyEngine(self.tensors, self.groups, self.shard, self.bpc, **kw)  # type: ignore[arg-type]
        return CpuCopyEngine(self.tensors, self.groups, self.shard, self.bpc, **kw)  # type: ignore[arg-type]


FAKES: list[FakeCuda] = []
"""The fake CUDA layers this test made (`make_setup`): their stream threads end after it."""


@pytest.fixture(autouse=True)
def _close_fakes() -> Iterator[None]:
    yield
    while FAKES:
        fake = FAKES.pop()
        fake.close()
        assert not fake.callback_errors, fake.callback_errors


@pytest.fixture(
    params=["cpu", "fake-cuda", "fake-pageable", pytest.param("cuda", marks=pytest.mark.gpu)]
)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    return str(request.param)


def new_fake(**kw: Any) -> FakeCuda:
    fake = FakeCuda(**kw)
    FAKES.append(fake)
    return fake


def make_setup(
    bpc: int = 1,
    num_blocks: int = 64,
    num_slots: int = 32,
    shard: torch.Tensor | None = None,
    seed: int = 0,
    device: str = "cpu",
    fake: FakeCuda | None = None,
) -> Setup:
    """`device`: cpu, cuda, or fake-cuda / fake-pageable (CPU tensors as the fake's device
    memory, the shard pinned or not; `fake`: that fake, else a new one)."""
    if device.startswith("fake") and fake is None:
        fake = new_fake()
    gen = torch.Generator().manual_seed(seed)
    pages = [256, 512, 128]
    tensors = []
    for page in pages:  # rows padded beyond the page, as vLLM's views may be
        base = torch.randint(-128, 127, (num_blocks, page + 64), dtype=torch.int8, generator=gen)
        tensors.append(KVTensor(base.to("cuda" if device == "cuda" else "cpu")[:, :page], page))
    # Group 0 uses tensors 0 and 1 (tensor 1 twice: aliased layers); group 1 uses tensor 2,
    # with fewer bytes than its page (an unpadded size).
    groups = [[GroupRef(0, 256), GroupRef(1, 512), GroupRef(1, 512)], [GroupRef(2, 100)]]
    shard_bytes = sum(pages) * bpc
    if shard is None:
        # Two workers' shards side by side; this one is rank 1, so the slot stride is larger.
        buffer = torch.zeros((num_slots, 2 * shard_bytes + 32), dtype=torch.uint8)
        if device == "cuda":
            buffer = buffer.pin_memory()
        elif device == "fake-cuda" and fake is not None:
            fake.pin(buffer)
        shard = buffer[:, shard_bytes : 2 * shard_bytes]
    offsets = list(np.cumsum([0] + [p * bpc for p in pages])[:-1])
    return Setup(tensors, groups, shard, bpc, [int(o) for o in offsets], fake)


def reference_store(setup: Setup, blocks: EngineBlocks, slots: list[int]) -> torch.Tensor:
    """vLLM's byte mapping, written as plain loops (independent of plan_copy)."""
    expected = setup.shard.clone()
    g_off = s_off = 0
    for g, n in enumerate(blocks.group_sizes):
        if n == 0:
            continue
        skip = blocks.block_indices[g] % setup.bpc
        nchunks = -(-(n + skip) // setup.bpc)
        subs = [(c, j) for c in slots[s_off : s_off + nchunks] for j in range(setup.bpc)]
        for k in range(n):
            block = int(blocks.block_ids[g_off + k])
            slot, j = subs[skip + k]
            for ref in setup.groups[g]:
                kv = setup.tensors[ref.tensor_index]
                at = setup.offsets[ref.tensor_index] + j * kv.page_bytes
                expected[slot, at : at + ref.nbytes] = kv.tensor[block, : ref.nbytes].view(
                    torch.uint8
                )
        g_off += n
        s_off += nchunks
    return expected


def random_transfer(
    rng: random.Random, setup: Setup, free_blocks: list[int], free_slots: list[int]
) -> tuple[EngineBlocks, list[int]]:
    sizes, starts, ids, slots = [], [], [], []
    for _ in setup.groups:
        n = rng.randrange(0, 6)
        start = rng.randrange(0, 9) if n else 0  # often not a multiple: a partial first chunk
        nchunks = -(-(n + start % setup.bpc) // setup.bpc) if n else 0
        ids += [free_blocks.pop() for _ in range(n)]
        slots += [free_slots.pop() for _ in range(nchunks)]
        sizes.append(n)
        starts.append(start)
    return EngineBlocks.of(ids, sizes, starts), slots


@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_is_byte_exact(device: str, bpc: int, seed: int) -> None:
    rng = random.Random(seed)
    setup = make_setup(bpc=bpc, seed=seed, device=device)
    engine = setup.engine()
    free_blocks = rng.sample(range(1, 64), 60)
    free_blocks[:10] = sorted(free_blocks[:10])  # some consecutive ids: coalesced copies
    free_slots = rng.sample(range(32), 32)
    transfers = [random_transfer(rng, setup, free_blocks, free_slots) for _ in range(3)]
    originals = [kv.tensor.clone() for kv in setup.tensors]
    for job_id, (blocks, slots) in enumerate(transfers):
        expected = reference_store(setup, blocks, slots)
        engine.submit_store(job_id, blocks, slots)
        engine.wait([job_id])
        assert torch.equal(setup.shard, expected)
    for kv in setup.tensors:
        kv.tensor.zero_()
    for job_id, (blocks, slots) in enumerate(transfers, start=10):
        engine.submit_load(job_id, slots, blocks)
    engine.wait(range(10, 13))
    for job_id, (blocks, _) in enumerate(transfers):
        g_off = 0
        for g, n in enumerate(blocks.group_sizes):
            for block in blocks.block_ids[g_off : g_off + n]:
                for ref in setup.groups[g]:
                    t = ref.tensor_index
                    got = setup.tensors[t].tensor[block, : ref.nbytes]
                    assert torch.equal(got, originals[t][block, : ref.nbytes]), (job_id, g, block)
            g_off += n
    results = engine.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2, 10, 11, 12]
    assert all(r.ok and r.seconds >= 0 for r in results)
    engine.shutdown()


def test_reported_bytes_count_every_copy(device: str) -> None:
    setup = make_setup(bpc=2, device=device)
    engine = setup.engine()
    # Group 0: 3 blocks x (256 + 512) bytes; group 1: 2 blocks x 100 bytes.
    engine.submit_store(1, EngineBlocks.of([5, 6, 7, 9, 11], [3, 2], [0, 1]), [4, 5, 6, 7])
    engine.wait([1])
    (result,) = engine.get_finished()
    assert result.ok and result.nbytes == 3 * 768 + 2 * 100 and result.direction is Direction.STORE
    engine.shutdown()


def test_writes_into_a_shared_region_shard(device: str, tmp_path: Path) -> None:
    pages_total = 256 + 512 + 128
    layout = RegionLayout(num_slots=8, shard_bytes=pages_total, num_workers=2)
    with PrimaryRegion.create("engine", layout, tmp_path) as region:
        fake = new_fake() if device.startswith("fake") else None
        if device == "cuda":
            assert region.pin(1)
        elif device == "fake-cuda" and fake is not None:
            assert region.pin(1, driver=fake.driver)
        setup = make_setup(num_slots=8, shard=region.shard_tensor(1), device=device, fake=fake)
        engine = setup.engine()
        engine.submit_store(1, EngineBlocks.of([3], [1, 0], [0, 0]), [6])
        engine.wait([1])
        engine.shutdown()
        slot = region.slots()[6]  # the scheduler's view of the same pages
        block = setup.tensors[0].tensor[3].view(torch.uint8).cpu().numpy()
        assert bytes(slot[pages_total : pages_total + 256]) == block.tobytes()
        assert not slot[:pages_total].any()  # rank 0's shard untouched
        del setup, engine, slot


def test_jobs_finish_in_order_and_loads_follow_their_stores(device: str) -> None:
    setup = make_setup(num_blocks=256, num_slots=128, device=device)
    engine = setup.engine()
    rng = random.Random(5)
    order: dict[Direction, list[int]] = {Direction.STORE: [], Direction.LOAD: []}
    checks = []
    for job_id in range(0, 400, 2):
        slot = rng.randrange(128)
        src, dst = rng.randrange(1, 128), rng.randrange(128, 256)
        setup.tensors[0].tensor[src].fill_(job_id % 100)
        # Store block src into a slot, then at once load that slot into another block: the
        # load must see this store's bytes, not an older one's.
        engine.submit_store(job_id, EngineBlocks.of([src], [1, 0], [0, 0]), [slot])
        engine.submit_load(job_id + 1, [slot], EngineBlocks.of([dst], [1, 0], [0, 0]))
        order[Direction.STORE].append(job_id)
        order[Direction.LOAD].append(job_id + 1)
        engine.wait([job_id + 1])
        checks.append(int(setup.tensors[0].tensor[dst, 0]) == job_id % 100)
    results = engine.get_finished()
    for direction, ids in order.items():
        assert [r.job_id for r in results if r.direction is direction] == ids
    assert all(checks) and all(r.ok for r in results)
    engine.shutdown()


def test_many_jobs_without_waiting(device: str) -> None:
    setup = make_setup(num_blocks=256, num_slots=128, device=device)
    engine = setup.engine()
    for job_id in range(300):
        engine.submit_store(
            job_id, EngineBlocks.of([job_id % 200 + 1], [1, 0], [0, 0]), [job_id % 128]
        )
    seen: list[int] = []
    while len(seen) < 300:
        seen += [r.job_id for r in engine.get_finished()]
    assert seen == list(range(300))  # each exactly once, in order
    assert engine.get_finished() == []
    engine.shutdown()


def test_wait_for_stores_and_loads(device: str) -> None:
    setup = make_setup(device=device)
    engine = setup.engine()
    setup.tensors[0].tensor[1].fill_(9)
    engine.submit_store(1, EngineBlocks.of([1], [1, 0], [0, 0]), [0])
    engine.submit_load(2, [0], EngineBlocks.of([2], [1, 0], [0, 0]))
    engine.wait([2, 77])  # a load id, and an unknown one
    assert int(setup.tensors[0].tensor[2, 0]) == 9
    assert sorted(r.job_id for r in engine.get_finished()) == [1, 2]
    engine.wait([1, 2])  # finished and reported: returns at once
    assert engine.get_finished() == []
    engine.shutdown()


def test_wait_blocks_until_a_held_job_finishes() -> None:
    setup = make_setup()
    gate = threading.Event()

    def slow(job: CopyJob) -> None:
        if job.job_id == 1:
            gate.wait(5)

    engine = setup.engine(fault=slow)
    engine.submit_store(1, EngineBlocks.of([1], [1, 0], [0, 0]), [0])
    engine.submit_load(2, [0], EngineBlocks.of([2], [1, 0], [0, 0]))
    engine.wait([99, 100])  # unknown ids: returns at once
    assert engine.get_finished() == []  # job 1 is held, job 2 queued behind it
    threading.Timer(0.2, gate.set).start()
    engine.wait([2])  # a load id: blocks until it (and the store before it) are done
    assert sorted(r.job_id for r in engine.get_finished()) == [1, 2]
    engine.wait([1, 2])  # finished and reported: returns at once
    assert engine.get_finished() == []
    engine.shutdown()


class Hold:
    """Keeps one lane of an engine busy until released: on the CPU engine a fault hook that
    blocks the held job's copy thread; on the fake CUDA layer a gate queued on the lane's
    stream before the job; on CUDA a sleep kernel queued on the lane's stream before the job
    (it then ends on its own, about a second later)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.gate = threading.Event()
        self.held: set[int] = set()

    def engine(self) -> CopyEngine:
        def hold(job: CopyJob) -> None:
            if job.job_id in self.held:
                assert self.gate.wait(10), "held job never released"

        if self.setup.tensors[0].tensor.is_cuda or self.setup.fake is not None:
            return self.setup.engine()
        return self.setup.engine(fault=hold)

    def before(self, engine: CopyEngine, job_id: int, lane: str) -> None:
        """Hold job `job_id`, about to be submitted to `lane` (store, load, expedited)."""
        if self.setup.fake is not None:  # a gate queued on the lane's stream before the job
            self.setup.fake.launch(engine._streams[lane], lambda: self.gate.wait(10))  # type: ignore[attr-defined]
        elif self.setup.tensors[0].tensor.is_cuda:
            with torch.cuda.stream(engine._streams[lane]):  # type: ignore[attr-defined]
                torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles
        else:
            self.held.add(job_id)

    def release(self) -> None:
        self.gate.set()

    def release_soon(self, engine: CopyEngine, reported: list[int]) -> None:
        """CPU: check that after 0.2 s only `reported` have finished (the held job, and what
        must follow it, have not), then release the held job 0.2 s later. CUDA: nothing (the
        sleep ends on its own, and its timing is the GPU's)."""
        if self.setup.tensors[0].tensor.is_cuda:
            return
        time.sleep(0.2)
        assert sorted(r.job_id for r in engine.get_finished()) == reported
        threading.Timer(0.2, self.release).start()


def waits_at_most(seconds: float, engine: CopyEngine, job_ids: list[int]) -> bool:
    """Whether `engine.wait(job_ids)` returns within `seconds` (it keeps waiting if not)."""
    waiter = threading.Thread(target=engine.wait, args=(job_ids,), daemon=True)
    waiter.start()
    waiter.join(seconds)
    return not waiter.is_alive()


def one(block: int) -> EngineBlocks:
    return EngineBlocks.of([block], [1, 0], [0, 0])


def test_an_expedited_load_does_not_queue_behind_earlier_jobs(device: str) -> None:
    setup = make_setup(device=device)
    hold = Hold(setup)
    engine = hold.engine()
    setup.tensors[0].tensor[1].fill_(7)
    engine.submit_store(0, one(1), [0])
    engine.wait([0])
    hold.before(engine, 1, "store")
    engine.submit_store(1, one(2), [1])  # held
    hold.before(engine, 2, "load")
    engine.submit_load(2, [5], one(3))  # a regular load: queued behind the store (CPU) or held
    engine.submit_load(3, [0], one(4), expedited=True)  # reads slot 0, written by job 0
    try:
        assert waits_at_most(5, engine, [3]), "the expedited load waited for the held jobs"
        assert int(setup.tensors[0].tensor[4, 0]) == 7
        assert sorted(r.job_id for r in engine.get_finished()) == [0, 3]
    finally:
        hold.release()
    engine.wait([1, 2])
    assert sorted(r.job_id for r in engine.get_finished()) == [1, 2]
    engine.shutdown()


def test_an_expedited_load_waits_for_the_store_of_its_slot(device: str) -> None:
    setup = make_setup(device=device)
    hold = Hold(setup)
    engine = hold.engine()
    setup.tensors[0].tensor[1].fill_(11)
    hold.before(engine, 1, "store")
    engine.submit_store(1, one(1), [3])  # held; writes slot 3
    engine.submit_load(2, [3], one(2), expedited=True)
    hold.release_soon(engine, [])  # the load did not overtake the store it reads
    engine.wait([2])
    assert int(setup.tensors[0].tensor[2, 0]) == 11  # the stored bytes, not the slot's old zeros
    engine.wait([1])
    assert sorted(r.job_id for r in engine.get_finished()) == [1, 2]
    engine.shutdown()


def test_a_later_job_waits_for_the_expedited_load_it_conflicts_with(device: str) -> None:
    setup = make_setup(device=device)
    hold = Hold(setup)
    engine = hold.engine()
    setup.tensors[0].tensor[1].fill_(5)
    engine.submit_store(0, one(1), [0])
    engine.wait([0])
    hold.before(engine, 1, "expedited")
    engine.submit_load(1, [0], one(2), expedited=True)  # held; writes engine block 2
    engine.submit_store(2, one(2), [4])  # reads engine block 2: must see the loaded bytes
    hold.release_soon(engine, [0])
    engine.wait([1, 2])
    assert int(setup.shard[4, 0]) == 5
    engine.shutdown()


def test_an_expedited_load_does_not_wait_for_a_queued_load_of_the_same_slot(device: str) -> None:
    setup = make_setup(device=device)
    hold = Hold(setup)
    engine = hold.engine()
    setup.tensors[0].tensor[1].fill_(9)
    engine.submit_store(0, one(1), [0])
    engine.wait([0])
    hold.before(engine, 1, "load")
    engine.submit_load(1, [7], one(20))  # held (CPU: the regular lane's backlog)
    engine.submit_load(2, [0], one(5))  # another request's load of slot 0, queued behind it
    engine.submit_load(3, [0], one(6), expedited=True)  # two reads of one slot: no order
    try:
        assert waits_at_most(5, engine, [3]), "the expedited load waited for a load that reads"
        assert int(setup.tensors[0].tensor[6, 0]) == 9
    finally:
        hold.release()
    engine.wait([1, 2])
    engine.shutdown()


def test_a_job_id_used_again_after_its_report_does_not_tie_the_lanes(device: str) -> None:
    setup = make_setup(device=device)
    hold = Hold(setup)
    engine = hold.engine()
    hold.before(engine, 100, "expedited")
    engine.submit_load(100, [10], one(10), expedited=True)  # holds the expedited lane
    engine.submit_store(5, one(1), [0])
    engine.submit_load(6, [0], one(2), expedited=True)  # reads slot 0: follows store 5
    engine.wait([5])
    assert 5 in [r.job_id for r in engine.get_finished()]  # reported: id 5 is free again
    engine.submit_store(5, one(2), [1])  # reads block 2, which job 6 writes: follows it
    hold.release()
    assert waits_at_most(10, engine, [6, 5]), "the lanes wait for each other"
    engine.shutdown()


def test_submitting_an_expedited_load_behind_a_long_backlog_is_quick() -> None:
    setup = make_setup(num_blocks=4096, num_slots=4096)
    hold = Hold(setup)
    engine = hold.engine()
    rng = np.random.default_rng(0)
    hold.before(engine, 0, "load")
    for job_id in range(1000):  # stores of 16 blocks each, queued behind a held one
        ids = rng.choice(np.arange(100, 4096), 16, replace=False)
        first = 16 + job_id % 100
        engine.submit_store(job_id, EngineBlocks.of(ids, [16, 0], [0, 0]), range(first, first + 16))
    start = time.perf_counter()
    engine.submit_load(1000, [4000], one(5), expedited=True)
    took = time.perf_counter() - start
    hold.release()
    engine.wait(range(1001))
    engine.shutdown()
    # What it costs depends on the new job's size, not on the 1000 queued (about 0.1 s before).
    assert took < 0.005, f"one submit_load took {took * 1e3:.1f} ms"


@pytest.mark.gpu
@pytest.mark.parametrize("expedited", [False, True])
def test_a_load_lands_after_what_the_compute_stream_queued_before_it(expedited: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    setup = make_setup(device="cuda")
    engine = setup.engine()
    setup.tensors[0].tensor[1].fill_(7)
    engine.submit_store(0, one(1), [0])
    engine.wait([0])
    torch.cuda._sleep(2_000_000_000)  # the compute stream is busy (~1 s)...
    setup.tensors[0].tensor[4].zero_()  # ...then zeroes block 4, as vLLM zeroes new blocks
    engine.submit_load(1, [0], one(4), expedited=expedited)
    engine.wait([1])
    torch.cuda.synchronize()
    assert int(setup.tensors[0].tensor[4, 0]) == 7, "the load landed before the zeroing"
    engine.shutdown()


def test_failed_jobs_are_reported_and_later_jobs_run(device: str) -> None:
    setup = make_setup(device=device)

    def fail_three(job: CopyJob) -> None:
        if job.job_id == 3:
            raise OSError("injected")

    engine = setup.engine(fault=fail_three)
    one = EngineBlocks.of([1], [1, 0], [0, 0])
    engine.submit_store(3, one, [0])
    engine.submit_store(4, EngineBlocks.of([999], [1, 0], [0, 0]), [1])  # no such block
    engine.submit_store(5, one, [40])  # no such slot
    engine.submit_store(6, EngineBlocks.of([1, 2], [2, 0], [0, 0]), [0])  # 2 blocks, 1 slot
    engine.submit_store(7, one, [2])
    engine.wait(range(3, 8))
    results = {r.job_id: r for r in engine.get_finished()}
    assert "injected" in (results[3].error or "")
    assert "engine block id out of range 0..63" in (results[4].error or "")
    assert "slot out of range 0..31" in (results[5].error or "")
    assert "need 2 slots; only 1 left" in (results[6].error or "")
    assert [results[i].ok for i in range(3, 8)] == [False, False, False, False, True]
    assert not setup.shard[1].any() and not setup.shard[0].any()  # failed jobs wrote nothing
    assert setup.shard[2].any()
    engine.shutdown()


@pytest.mark.parametrize("waited", [True, False], ids=["waited", "polled"])
def test_a_dead_copy_thread_fails_its_job_and_later_ones_and_counts_loads_right(
    waited: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy thread killed in the middle of a job (a BaseException that the engine does not
    catch): the job it was copying and those queued behind it report failed, whether the engine
    is waited on or only polled; a load the other lane is still copying reports as usual and
    then drops the GIL claim (the count of loads does not go below zero); later jobs fail at
    once instead of queueing behind a dead lane forever."""
    import sys

    from tiering import gil

    class Killed(BaseException):
        pass

    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's end: quiet
    before = sys.getswitchinterval()
    setup = make_setup(device="cpu")
    started, gate = threading.Event(), threading.Event()

    def fault(job: CopyJob) -> None:
        if job.job_id == 1:
            raise Killed  # not an Exception: ends the lane's thread
        if job.job_id == 3:
            started.set()
            assert gate.wait(10)

    engine = setup.engine(fault=fault)
    engine.submit_load(3, [1], one(5), expedited=True)  # held on the expedited lane
    assert started.wait(5)
    engine.submit_load(1, [0], one(3))  # kills the regular lane's thread
    engine.submit_load(2, [2], one(4))  # queued behind it
    deadline = time.monotonic() + 5
    results: dict[int, CopyResult] = {}
    if waited:
        assert waits_at_most(5, engine, [1, 2])
    while set(results) != {1, 2} and time.monotonic() < deadline:
        results.update((r.job_id, r) for r in engine.get_finished())
        time.sleep(0.01)
    assert {i: (r.ok, r.error) for i, r in results.items()} == {
        1: (False, "copy thread died"),
        2: (False, "copy thread died"),
    }
    assert sys.getswitchinterval() == pytest.approx(gil.DEFAULT_INTERVAL)  # job 3 is copied
    gate.set()
    assert waits_at_most(5, engine, [3])
    (result,) = engine.get_finished()
    assert result.job_id == 3 and result.ok
    assert sys.getswitchinterval() == pytest.approx(before) and gil.holders() == 0
    engine.submit_load(4, [3], one(6))
    engine.submit_store(5, one(6), [4])
    assert [(r.job_id, r.ok, r.error) for r in engine.get_finished()] == [
        (4, False, "copy thread died"),
        (5, False, "copy thread died"),
    ]
    assert sys.getswitchinterval() == pytest.approx(before) and gil.holders() == 0
    engine.shutdown()


def test_submitting_after_shutdown_fails_the_job(device: str) -> None:
    setup = make_setup(device=device)
    engine = setup.engine()
    engine.shutdown()
    engine.submit_store(1, EngineBlocks.of([1], [1, 0], [0, 0]), [0])
    (result,) = engine.get_finished()
    assert not result.ok and result.error == "engine is shut down"


def test_job_id_twice_is_misuse(device: str) -> None:
    setup = make_setup(device=device)
    engine = setup.engine()
    blocks = EngineBlocks.of([1], [1, 0], [0, 0])
    engine.submit_store(1, blocks, [0])
    with pytest.raises(StateError, match="copy job 1 was submitted twice"):
        engine.submit_store(1, blocks, [1])
    engine.wait([1])
    engine.get_finished()
    engine.submit_store(1, blocks, [1])  # reported: the id may be used again
    engine.shutdown()


def test_plan_groups_and_partial_first_chunk() -> None:
    groups = [[GroupRef(0, 8)], [GroupRef(1, 4)]]
    blocks = EngineBlocks.of([10, 11, 12, 20], [3, 1], [2, 5])
    rows = plan_copy(blocks, [7, 8, 9], 4, groups)
    # Group 0 starts at sub-block 2 of slot 7 (index 2 % 4), spans into slot 8; group 1 starts
    # at sub-block 1 of slot 9.
    assert [r.tensor_index for r in rows] == [0, 1]
    assert list(rows[0].engine_rows) == [10, 11, 12]
    assert list(rows[0].slot_rows) == [7 * 4 + 2, 7 * 4 + 3, 8 * 4 + 0]
    assert list(rows[1].slot_rows) == [9 * 4 + 1]


@pytest.mark.parametrize(
    ("blocks", "slots", "message"),
    [
        (EngineBlocks.of([1, 2], [2], [0]), [0], "transfer names 1 groups"),
        (EngineBlocks.of([1, 2], [1, 0], [0, 0]), [0], "leaves 1 block ids and 0 slots unused"),
        (EngineBlocks.of([1], [1, 0], [0, 0]), [0, 1], "leaves 0 block ids and 1 slots unused"),
        (EngineBlocks.of([1], [2, 0], [0, 0]), [0, 1], "2 blocks, only 1 block ids left"),
        (EngineBlocks.of([1], [-1, 0], [0, 0]), [0], "negative size"),
    ],
)
def test_plan_rejects_mismatched_sides(
    blocks: EngineBlocks, slots: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_copy(blocks, slots, 1, [[GroupRef(0, 8)], [GroupRef(1, 8)]])


def test_engine_rejects_a_bad_geometry() -> None:
    setup = make_setup()
    with pytest.raises(ValueError, match="the shard has"):
        CpuCopyEngine(setup.tensors, setup.groups, setup.shard, 2)
    with pytest.raises(ValueError, match="do not fit the tensor's page"):
        CpuCopyEngine(setup.tensors, [[GroupRef(2, 129)]], setup.shard, 1)
    with pytest.raises(ValueError, match="refers to KV tensor 3"):
        CpuCopyEngine(setup.tensors, [[GroupRef(3, 1)]], setup.shard, 1)
    flat = [KVTensor(torch.zeros(64, dtype=torch.int8), 8)]  # 1-D: refused, not an IndexError
    with pytest.raises(ValueError, match="must be \\(num_blocks, row\\)"):
        CpuCopyEngine(flat, [[GroupRef(0, 8)]], setup.shard, 1)


def test_fallback_without_the_compiled_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiers.copy.cpu as cpu

    assert cpu._copy_batch is not None  # an install builds the helper
    monkeypatch.setattr(cpu, "_copy_batch", None)
    setup = make_setup(bpc=2)
    engine = setup.engine()
    blocks = EngineBlocks.of([3, 4, 5, 9], [3, 1], [1, 0])
    expected = reference_store(setup, blocks, [6, 7, 2])
    engine.submit_store(1, blocks, [6, 7, 2])
    engine.wait([1])
    assert torch.equal(setup.shard, expected)
    engine.shutdown()


def test_the_gil_comes_back_sooner_while_a_load_is_copied() -> None:
    """A request waits on its loads while the engine's loop spins holding the GIL: while a load
    is queued or copied the switch interval is short (`tiering.gil`); stores do not claim it."""
    import sys

    from tiering import gil

    before = sys.getswitchinterval()
    setup = make_setup(device="cpu")
    hold = Hold(setup)
    engine = hold.engine()
    try:
        hold.before(engine, 1, "store")
        engine.submit_store(1, one(1), [0])  # held
        assert sys.getswitchinterval() == pytest.approx(before)  # a store alone: no claim
        engine.submit_load(2, [0], one(2))  # queued behind the held store
        assert sys.getswitchinterval() == pytest.approx(gil.DEFAULT_INTERVAL)
    finally:
        hold.release()
    engine.wait([1, 2])
    assert sys.getswitchinterval() == pytest.approx(before)
    assert gil.holders() == 0
    engine.shutdown()
