"""Each rank's GPU in the service: learnt from the message a rank sends once, kept per run and rank
(bounded, in the saved state, carried to a temporal stage on the summaries), credited to the host
ledger with the rank's host, and kept by a capture that is replayed."""

from __future__ import annotations

import json

from detector_synth import Fault, SyntheticRun
from sdcwatch.core.messages import decode_message
from sdcwatch.core.rank_notes import RankDevice, encode_device
from sdcwatch.service.host_files import read_hosts, write_host_files
from sdcwatch.service.layer_name_book import LayerNameBook
from sdcwatch.service.offline import read_records
from sdcwatch.service.pipeline import DetectionPipeline
from sdcwatch.service.summary import decode_summary, encode_summary
from sdcwatch.telemetry import Emitter, FileTransport
from sdcwatch.telemetry.wire.environment import RankEnvironment

WORLD = 8


def devices(run: str) -> list:
    """What each rank of a host of four GPUs listed as 4,5,6,7 sends, decoded as the service does."""
    out = []
    for rank in range(WORLD):
        env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "LOCAL_RANK": str(rank % 4)}
        said = RankDevice(run, rank, WORLD, 0, RankEnvironment.read(env).gpu())
        out += decode_message(encode_device(said))
    return out


def synth(run: str) -> SyntheticRun:
    return SyntheticRun(world=WORLD, run=run, seed=1, faults=[Fault("checksum", 40, rank=1)])


def gpus_on(pipe: DetectionPipeline) -> dict[str, tuple[str, ...]]:
    return {v.host: v.gpus for v in pipe.hosts.verdicts(0.0)}


def test_the_pipeline_credits_the_gpu_of_the_rank_a_finding_names_to_its_host(tmp_path) -> None:
    pipe = DetectionPipeline(wall=lambda: 0.0)
    pipe.process(devices("job"))
    run = synth("job")
    for step in range(80):
        pipe.process(run.records(step))
    pipe.flush()
    assert pipe.names.gpus_of("job") == ["4", "5", "6", "7"] * 2
    assert gpus_on(pipe) == {"node0": ("5",)}  # rank 1: node0's second GPU, listed as 5
    write_host_files(tmp_path, pipe.hosts.verdicts(0.0), wall=0.0, clears_through=0.0)
    assert [h["gpus"] for h in read_hosts(tmp_path)["hosts"]] == [["5"]]  # what `sdcwatch hosts --json` prints
    again = DetectionPipeline()
    again.restore(json.loads(json.dumps(pipe.snapshot())))
    assert again.names.gpus_of("job") == pipe.names.gpus_of("job")


def test_without_devices_the_host_is_credited_with_no_gpu() -> None:
    pipe = DetectionPipeline(wall=lambda: 0.0)
    run = synth("job")
    for step in range(80):
        pipe.process(run.records(step))
    pipe.flush()
    assert gpus_on(pipe) == {"node0": ()} and pipe.names.gpus_of("job") == []


def test_split_stages_carry_the_gpus_to_the_temporal_stage_on_the_summaries() -> None:
    spatial, temporal = DetectionPipeline(stage="spatial"), DetectionPipeline(stage="temporal", wall=lambda: 0.0)
    spatial.process(devices("job"))
    run = synth("job")
    for step in range(80):
        spatial.process(run.records(step))
    spatial.flush()
    temporal.process_summaries([decode_summary(encode_summary(s)) for s in spatial.take_summaries()])
    temporal.flush()
    assert temporal.names.gpus_of("job") == ["4", "5", "6", "7"] * 2
    assert gpus_on(temporal) == {"node0": ("5",)}


def test_a_replayed_capture_keeps_the_gpu(tmp_path) -> None:
    path = tmp_path / "cap.jsonl"
    env = {"CUDA_VISIBLE_DEVICES": "3,5", "LOCAL_RANK": "1"}
    with Emitter(FileTransport(path), run="cap", rank=1, world=2, host="h", env=env) as em:
        for step in range(20):
            em.emit(step, loss=1.0)
    read = list(read_records(path, names=True))
    assert read[0] == RankDevice("cap", 1, 2, 0, "5")
    pipe = DetectionPipeline()
    pipe.process(read)
    assert pipe.names.gpus_of("cap") == ["", "5"]


def test_a_flood_of_gpus_stays_within_the_books_bounds() -> None:
    book = LayerNameBook(max_runs=4, max_bytes=4096)
    for i in range(100):
        book.take([RankDevice(f"flood-{i}", 0, 64, 0, f"{i}:GPU-{'x' * 40}")])
    assert book.bytes <= 4096 and len(book.snapshot()["runs"]) <= 4
    assert not book.place("huge", 0, 10_000, "0")  # its table alone is past the bytes: refused, counted
    assert book.refused == 1
    book.place("w", 3, 4, "3")
    book.place("w", 1, 2, "1")  # the run now has two ranks: rank 3's GPU goes with it
    assert book.gpus_of("w") == ["", "1"]
    for run in [*book.snapshot()["runs"]]:
        book.forget(run)
    assert book.bytes == 0


def test_a_gpu_on_a_summary_or_in_a_state_that_does_not_check_is_left_out() -> None:
    book = LayerNameBook()
    book.absorb("r", {"world": 2, "tables": {}, "ranks": {}, "gpus": {"0": "3", "1": "bad\x1b[0m"}})
    assert book.gpus_of("r") == ["3", ""] and book.refused == 1
