"""The CUDA copy engine's own behaviour on the fake CUDA layer (`tests/helpers/fake_cuda.py`):
the source order of its batches, its self-check, the per-piece path, driver and asynchronous
errors, its streams. The contract every engine keeps is in test_copy.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from tests.helpers.fake_cuda import STICKY, FakeCuda  # noqa: E402
from tiers.copy import EngineBlocks, GroupRef, KVTensor  # noqa: E402
from tiers.copy.cuda import CudaCopyEngine  # noqa: E402
from tiers.copy.cuda_driver import ORDER_ANY, ORDER_STREAM  # noqa: E402

ROW = 256


@pytest.fixture
def fakes() -> Iterator[list[FakeCuda]]:
    made: list[FakeCuda] = []
    yield made
    for fake in made:
        fake.close()
        assert not fake.callback_errors, fake.callback_errors


def build(
    fakes: list[FakeCuda], pinned: bool = True, **kw: object
) -> tuple[FakeCuda, CudaCopyEngine, torch.Tensor, torch.Tensor]:
    """A fake, an engine over one KV tensor of 64 blocks and a shard of 32 slots."""
    engine_kw = {"batch": kw.pop("engine_batch")} if "engine_batch" in kw else {}
    fake = FakeCuda(**kw)  # type: ignore[arg-type]
    fakes.append(fake)
    kv = torch.randint(0, 255, (64, ROW), dtype=torch.uint8)
    shard = torch.zeros((32, ROW), dtype=torch.uint8)
    if pinned:
        fake.pin(shard)
    engine = CudaCopyEngine(
        [KVTensor(kv, ROW)], [[GroupRef(0, ROW)]], shard, cuda=fake, **engine_kw
    )  # type: ignore[arg-type]
    return fake, engine, kv, shard


def one(block: int) -> EngineBlocks:
    return EngineBlocks.of([block], [1], [0])


def test_a_load_reads_out_of_stream_order_only_when_no_store_it_waits_for_is_in_flight(
    fakes: list[FakeCuda],
) -> None:
    fake, engine, kv, shard = build(fakes)
    gate = threading.Event()
    engine.submit_store(1, one(1), [0])
    engine.wait([1])
    assert [r.job_id for r in engine.get_finished()] == [1]  # no longer in flight
    fake.launch(engine._streams["store"], lambda: gate.wait(10))
    engine.submit_store(2, one(2), [3])  # held: in flight when the loads come
    engine.submit_load(3, [3], one(10))  # reads slot 3, which store 2 writes
    engine.submit_load(4, [0], one(11), expedited=True)  # slot 0: written by a finished store
    gate.set()
    engine.wait([2, 3, 4])
    assert fake.batches[-3:] == [[ORDER_STREAM], [ORDER_STREAM], [ORDER_ANY]]
    assert torch.equal(kv[10], kv[2]) and torch.equal(kv[11], kv[1])
    engine.shutdown()


def test_an_unpinned_shard_is_read_in_stream_order_and_logged(
    fakes: list[FakeCuda], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "tiers.copy.cuda"):
        fake, engine, kv, _ = build(fakes, pinned=False)
    assert not engine.pinned and "not pinned" in caplog.text
    engine.submit_store(1, one(1), [0])
    engine.wait([1])
    engine.submit_load(2, [0], one(2))
    engine.wait([2])
    assert fake.batches[-1] == [ORDER_STREAM] and torch.equal(kv[2], kv[1])
    engine.shutdown()


def test_an_error_pending_from_an_earlier_call_is_reported_as_such_and_batching_stays_on(
    fakes: list[FakeCuda], caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 13: torch's failed cudaHostRegister leaves the runtime's last error set; the
    self-check's first launch raises it. It is not the batch call's failure."""
    fake = FakeCuda()
    fakes.append(fake)
    held = torch.zeros(4096, dtype=torch.uint8)
    fake.pin(held)
    assert fake.runtime_host_register(held.data_ptr(), 4096) == 712  # already registered
    kv = torch.zeros((4, ROW), dtype=torch.uint8)
    shard = torch.zeros((4, ROW), dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, "tiers.copy.cuda"):
        engine = CudaCopyEngine([KVTensor(kv, ROW)], [[GroupRef(0, ROW)]], shard, cuda=fake)
    assert engine.batched
    assert "pending on this thread before the copy engine started" in caplog.text
    fake.launch_check()  # cleared: the next launch does not raise it again
    engine.shutdown()


@pytest.mark.parametrize(("failing", "batched"), [((1,), True), ((1, 2), False), ((2,), False)])
def test_a_self_check_that_cannot_launch_falls_back_to_per_piece_copies(
    fakes: list[FakeCuda], failing: tuple[int, ...], batched: bool
) -> None:
    """One failed first launch is taken for an error left by someone else (retried); a
    second, or a failure inside the check, turns batching off; copies still work."""
    fake, engine, kv, shard = build(fakes, fail={"launch": failing})
    assert engine.batched is batched
    engine.submit_store(1, one(3), [4])
    engine.wait([1])
    assert [r.ok for r in engine.get_finished()] == [True] and torch.equal(shard[4], kv[3])
    engine.shutdown()


@pytest.mark.parametrize(
    ("kw", "symbol"),
    [
        ({"fail": {"cuMemcpyBatchAsync_v2": 1}}, "cuMemcpyBatchAsync_v2"),
        ({"batch": None}, None),
        ({"batch": "v1"}, "cuMemcpyBatchAsync"),
    ],
    ids=["self-check-fails", "no-batch-call", "cuda-12.8-abi"],
)
def test_the_batch_call_is_used_when_found_and_sound(
    fakes: list[FakeCuda], kw: dict[str, object], symbol: str | None
) -> None:
    fake, engine, kv, shard = build(fakes, **kw)
    assert fake.driver.batch_symbol == symbol
    assert engine.batched is (kw == {"batch": "v1"})
    engine.submit_store(1, EngineBlocks.of([5, 6], [2], [0]), [7, 8])
    engine.wait([1])
    engine.submit_load(2, [7, 8], EngineBlocks.of([20, 21], [2], [0]))
    engine.wait([2])
    assert [r.ok for r in engine.get_finished()] == [True, True]
    assert torch.equal(kv[20:22], kv[5:7]) and torch.equal(shard[7:9], kv[5:7])
    engine.shutdown()


def test_a_self_check_with_the_batch_turned_off_is_not_run(fakes: list[FakeCuda]) -> None:
    fake, engine, _, _ = build(fakes, engine_batch=False)
    assert not engine.batched and fake.batches == []
    engine.shutdown()


def test_a_per_piece_copy_failing_part_way_is_reported_once_its_queued_pieces_ran(
    fakes: list[FakeCuda],
) -> None:
    """Finding 9: the third piece's cuMemcpyAsync fails after two were queued behind a held
    stream; the job is reported failed only after those two ran, and later jobs run."""
    fake, engine, kv, shard = build(fakes, batch=None, fail={"cuMemcpyAsync": 3})
    gate = threading.Event()
    fake.launch(engine._streams["store"], lambda: gate.wait(10))
    engine.submit_store(1, EngineBlocks.of([1, 2, 3, 4], [4], [0]), [0, 1, 2, 3])
    assert engine.get_finished() == []  # failed, but two of its pieces are still queued
    gate.set()
    engine.wait([1])
    (result,) = engine.get_finished()
    assert not result.ok and "cuMemcpyAsync failed with CUresult 999" in (result.error or "")
    assert torch.equal(shard[0:2], kv[1:3]) and not shard[2:4].any()
    engine.submit_store(2, one(9), [5])
    engine.wait([2])
    assert [r.ok for r in engine.get_finished()] == [True]
    engine.shutdown()


@pytest.mark.parametrize("waited", [True, False], ids=["waited", "polled"])
def test_an_asynchronous_cuda_error_is_a_failed_job(fakes: list[FakeCuda], waited: bool) -> None:
    """Finding 15: an error the stream hits after the call (here a sticky one, as a lost
    context gives) fails the jobs it is reported for; nothing raises out of the engine."""
    fake, engine, _, _ = build(fakes)
    fake._fail_op = fake._ops + 1  # the next copy a stream runs
    engine.submit_store(1, one(1), [0])
    if waited:
        engine.wait([1])
    else:
        fake.synchronize_quietly()
    engine.submit_store(2, one(2), [1])
    engine.wait([2])
    results = engine.get_finished()
    assert [(r.job_id, r.ok) for r in results] == [(1, False), (2, False)]
    assert all(STICKY in (r.error or "") for r in results)
    engine.shutdown()  # logs, does not raise


def test_a_load_lands_after_what_the_compute_stream_queued_before_it(
    fakes: list[FakeCuda],
) -> None:
    fake, engine, kv, _ = build(fakes)
    engine.submit_store(0, one(1), [0])
    engine.wait([0])
    gate = threading.Event()
    fake.launch(fake.compute, lambda: gate.wait(10))  # the compute stream is busy...
    fake.launch(fake.compute, lambda: kv[4].zero_())  # ...then zeroes block 4, as vLLM does
    engine.submit_load(1, [0], one(4), expedited=True)
    gate.set()
    engine.wait([1])
    assert torch.equal(kv[4], kv[1]), "the load landed before the zeroing"
    engine.shutdown()


def test_lanes_get_streams_of_their_own_where_the_pool_allows(
    fakes: list[FakeCuda], caplog: pytest.LogCaptureFixture
) -> None:
    fake, engine, _, _ = build(fakes)
    handles = {s.cuda_stream for s in engine._streams.values()}
    assert len(handles | {fake.compute.cuda_stream}) == 4
    with caplog.at_level(logging.WARNING, "tiers.copy.cuda"):
        _, crowded, _, _ = build(fakes, stream_pool=1)
    assert "shares its stream with others" in caplog.text
    engine.shutdown()
    crowded.shutdown()
    crowded.shutdown()  # idempotent


def test_an_empty_job_finishes_without_a_driver_call(fakes: list[FakeCuda]) -> None:
    fake, engine, _, _ = build(fakes)
    calls = len(fake.batches)
    engine.submit_store(1, EngineBlocks.of([], [0], [0]), [])
    engine.wait([1])
    assert [(r.ok, r.nbytes) for r in engine.get_finished()] == [(True, 0)]
    assert len(fake.batches) == calls
    engine.shutdown()


def test_the_engine_copies_between_device_tensors_and_a_host_shard_only(
    fakes: list[FakeCuda],
) -> None:
    fake = FakeCuda()
    fakes.append(fake)
    kv = torch.zeros((4, ROW), dtype=torch.uint8)
    on_device = torch.zeros((4, ROW), dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="between CUDA KV tensors and a host shard"):
        CudaCopyEngine([KVTensor(kv, ROW)], [[GroupRef(0, ROW)]], on_device, cuda=fake)
