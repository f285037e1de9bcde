"""What a speculative cycle reads back to the host on the CUDA backend, counted on its CPU twin (the same static steps,
replayed eagerly): every way of waiting for the device (`synchronize`, the package's own `sync`), a `nonzero` (its size
depends on the data), and every read of a tensor's value (`item`, `int`, `bool`, `float`, `tolist`). A cycle reads
once: its accepted run. The stage times come from events read at the end of the answer."""

import pytest
import torch
from test_spec import HostSyncs

from litevlm import Pipeline
from litevlm.data.synthetic import make_frame, render_views
from litevlm.model.generate import StageTimer

QUESTIONS = (
    "What are the important objects in the current scene?",
    "What actions should the ego vehicle take?",
    "Is there a car behind the ego car?",
)


class DeviceWaits(HostSyncs):
    """Counts the host's waits for the device while entered (see the module's docstring): a tensor's value read
    (`HostSyncs`), a `nonzero` without a size, and every synchronize."""

    def __enter__(self):
        import litevlm.model.backend as backend
        import litevlm.model.generate as generate

        super().__enter__()
        sized = lambda *a, **k: "size" not in k  # noqa: E731 - nonzero_static's size makes it wait for nothing
        self.counting(torch.Tensor, "nonzero", sized)
        self.counting(torch, "nonzero", sized)
        self.counting(torch.cuda, "synchronize")
        self.counting(generate, "sync")
        self.counting(backend, "_sync")
        return self


@pytest.fixture(scope="module")
def twin():
    """drive-tiny's LiteVLM decoding on the CUDA backend's twin, its chains of a fixed depth as on a GPU."""
    return Pipeline.from_pretrained("drive-tiny", backend="cuda-twin", speculative=True, tree_min_value=0.0)


def test_a_speculative_cycle_on_the_cuda_twin_reads_the_host_once(twin, monkeypatch):
    assert twin.backend.name == "cuda-twin" and twin.drafting and twin.tree.min_value == 0.0
    frame = twin.frame(render_views(make_frame(3, 1), size=(320, 180)))
    per_cycle, cycles = [], 0
    for q in QUESTIONS:
        st = twin.start_answer(q, frame)
        stream = twin.decode(st.prefilled, st.timer)
        next(stream)  # the prefill's own tokens
        while True:
            with DeviceWaits(monkeypatch) as waits:
                try:
                    next(stream)
                except StopIteration:
                    break
            per_cycle.append((waits.count, waits.seen))
            cycles += 1
    assert cycles >= 6  # the answers take several cycles each
    assert all(count == 1 for count, _ in per_cycle), per_cycle
    assert all(seen == ["tolist"] for _, seen in per_cycle)


def test_the_counter_sees_what_it_counts(monkeypatch):
    """A control: each kind of wait the cycle test holds to one is counted."""
    x = torch.tensor([0, 3, 0, 5])
    with DeviceWaits(monkeypatch) as waits:
        x.nonzero()
        torch.nonzero(x)
        int(x[1])
        x.tolist()
        x.sum().item()
        bool(x.any())
        StageTimer("cpu")  # makes no wait
        import litevlm.model.generate as generate

        generate.sync("cpu")
    assert waits.count == 7


class FakeEvent:
    """torch.cuda.Event's timing API on a clock the test moves: elapsed_time in ms between two records."""

    clock = 0.0
    waits = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = FakeEvent.clock

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, end):
        return end.t - self.t


def test_stage_times_on_a_gpu_come_from_events_read_once_at_the_end(monkeypatch):
    """On a CUDA device the timer waits for nothing at a stage's boundaries: it records events, and reads them all
    (one wait, on the latest) when its times are asked for; a stage's setup is left out as on the CPU."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the timer waited for the device"))
    FakeEvent.clock, FakeEvent.waits = 0.0, 0
    setup = [0.0]
    timer = StageTimer("cuda", setup=lambda: setup[0])
    assert timer.events
    with timer("decode"):
        FakeEvent.clock += 5.0
        with timer("draft"):
            FakeEvent.clock += 2.0
        with timer("verify"):
            FakeEvent.clock += 3.0
            setup[0] += 1.0  # a bucket compiled inside the stage: setup, not verify
    with timer("decode"):
        FakeEvent.clock += 4.0
    assert FakeEvent.waits == 0  # nothing read yet
    assert timer.ms == {"draft": 2.0, "verify": 2.0, "decode": 13.0}
    assert FakeEvent.waits == 1 and timer.setup_ms == 1.0
    assert timer.ms == {"draft": 2.0, "verify": 2.0, "decode": 13.0} and FakeEvent.waits == 1  # read once
