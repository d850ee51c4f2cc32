"""A rank's GPU: read from CUDA_VISIBLE_DEVICES and LOCAL_RANK (and from CUDA where the job initialised
it already, never initialising it), sent once ahead of the first records, again only if refused."""

from __future__ import annotations

import subprocess
import sys

from sdcwatch.core.messages import decode_message
from sdcwatch.core.rank_notes import GPU_MAGIC, RankDevice
from sdcwatch.telemetry import Emitter, MemoryBus, MemoryTransport
from sdcwatch.telemetry.wire.environment import RankEnvironment
from sdcwatch.telemetry.wire.outbox import NamesOutbox

UUID = "8f2e1c3a-0000-4000-8000-00000000abcd"


class Props:
    uuid = UUID


class FakeCuda:
    """``torch.cuda`` of a host with ``n`` GPUs, initialised."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.asked: list[int] = []

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.n

    def get_device_properties(self, i: int) -> Props:
        self.asked.append(i)
        return Props()


def gpu(env: dict[str, str], cuda=None, ordinal=None) -> str:
    return RankEnvironment.read(env).gpu(cuda, ordinal)


def test_the_physical_index_is_the_visible_entry_of_the_ranks_device() -> None:
    assert gpu({"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": "1"}) == "5"
    assert gpu({"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": "0"}) == "3"
    assert gpu({"CUDA_VISIBLE_DEVICES": "7", "LOCAL_RANK": "3"}) == "7"  # one GPU bound per task (Slurm)
    assert gpu({"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": "4"}) == ""  # none of those listed
    assert gpu({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb", "LOCAL_RANK": "1"}) == "GPU-bb"


def test_a_cpu_rank_reports_none() -> None:
    assert gpu({}) == "" and gpu({"LOCAL_RANK": "2"}) == ""
    assert gpu({"CUDA_VISIBLE_DEVICES": ""}) == "" and gpu({"CUDA_VISIBLE_DEVICES": "-1"}) == ""


def test_initialised_cuda_gives_the_uuid_of_the_current_device() -> None:
    cuda = FakeCuda()
    assert gpu({"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": "0"}, cuda, ordinal=1) == f"5:GPU-{UUID}"
    assert cuda.asked == [1]  # the logical ordinal: CUDA numbers the visible devices from 0
    assert gpu({"LOCAL_RANK": "1"}, cuda) == f"1:GPU-{UUID}"  # no variable: every GPU visible
    assert gpu({"LOCAL_RANK": "5"}, cuda) == ""  # not a device CUDA counts: unknown


def test_an_emitter_sends_its_gpu_once_ahead_of_its_first_records_without_probes() -> None:
    bus = MemoryBus()
    env = {"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": "1"}
    with Emitter(MemoryTransport(bus), run="r", rank=1, world=2, host="h", env=env) as em:
        for step in range(100):  # several key windows
            em.emit(step, loss=1.0)
    values = [v for _, v in bus.messages(em.transport.topic)]
    said = [v for v in values if v[:4] == GPU_MAGIC]
    assert len(said) == 1 and values[0] == said[0]
    assert decode_message(said[0]) == [RankDevice("r", 1, 2, 0, "5")]
    assert em.sent == 100 and bus.records()[0].step == 0


def test_a_cpu_emitter_sends_no_gpu_and_its_records_are_unchanged() -> None:
    bus = MemoryBus()
    with Emitter(MemoryTransport(bus), run="r", rank=0, world=1, host="h", env={}, wire="v1") as em:
        em.emit(0, loss=1.0, time=5.0)
    assert not [v for _, v in bus.messages(em.transport.topic) if v[:4] == GPU_MAGIC]
    assert em.names.device is None


class Refusing:
    """A transport that refuses its first send."""

    def __init__(self) -> None:
        self.sent: list[list] = []
        self.refuse = 1

    def send(self, items: list) -> None:
        if self.refuse:
            self.refuse -= 1
            raise ConnectionError("down")
        self.sent.append(list(items))


def test_a_refused_gpu_goes_again_with_the_next_batch_and_a_failing_read_sends_none() -> None:
    out, transport = NamesOutbox("r", 0, 1, gpu=lambda: "2"), Refusing()
    out.note(0)
    out.send(transport)  # refused
    out.note(1)
    out.send(transport)
    out.note(2)
    out.send(transport)
    assert transport.sent == [[RankDevice("r", 0, 1, 0, "2")]]

    def broken() -> str:
        raise RuntimeError("no driver")

    quiet = NamesOutbox("r", 0, 1, gpu=broken)
    quiet.note(0)
    quiet.send(transport)
    assert quiet.device is None and len(transport.sent) == 1


def test_reading_the_gpu_neither_imports_torch_nor_initialises_cuda() -> None:
    code = (
        "import sys; from sdcwatch.telemetry.wire.environment import RankEnvironment, initialised_cuda\n"
        "env = RankEnvironment.read({'CUDA_VISIBLE_DEVICES': '3,5', 'LOCAL_RANK': '1'})\n"
        "assert env.gpu(initialised_cuda()) == '5' and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
