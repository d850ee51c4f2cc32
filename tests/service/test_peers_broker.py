"""A tp=2, pp=2, dp=4 job through the real broker: emitters with mesh coordinates, v1 and v2 ranks
mixed, into the detector service; a NaN is named on its rank with its coordinates, not on the
later stage that received it, and the healthy differences between pieces raise nothing."""

from __future__ import annotations

import uuid

import pytest
from mesh_synth import MeshFault, MeshRun
from polling import step_until
from stand_ins import ListSink
from sdcwatch.service.kafka_source import KafkaSource
from sdcwatch.service.loop import DetectorService
from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings
from sdcwatch.telemetry import Emitter, KafkaTransport

pytestmark = pytest.mark.integration


def test_a_3d_job_through_the_broker_names_the_nan_rank_with_its_coordinates(bootstrap, unique_topic):
    steps, bad_step = 40, 30
    mesh = MeshRun()
    bad = mesh.rank_of(tp=1, pp=0, dp=2)
    mesh.faults = [MeshFault("nonfinite", step=bad_step, rank=bad)]
    emitters = [
        Emitter(
            KafkaTransport(bootstrap, unique_topic),
            run=mesh.run,
            rank=r,
            world=mesh.world,
            host=mesh.host(r),
            coords=mesh.coords(r),
            wire="v2" if r % 2 else "v1",
        )
        for r in range(mesh.world)
    ]
    for step in range(steps):
        for rec in mesh.records(step):
            emitters[rec.rank].emit(step, layers=rec.layers, fingerprints=rec.fingerprints, **rec.scalars)
    for em in emitters:
        em.close()
    assert [(em.sent, em.invalid) for em in emitters] == [(steps, 0)] * mesh.world
    source = KafkaSource(
        bootstrap, unique_topic, group=f"g-{uuid.uuid4().hex[:8]}", deadletter_topic=f"{unique_topic}.dead"
    )
    sink = ListSink()
    pipe = DetectionPipeline(PipelineSettings(align_timeout_s=30.0))
    svc = DetectorService(source, pipe, sinks=[sink], poll_timeout=0.5)
    step_until(svc.step, lambda: pipe.records_total >= mesh.world * steps, 90, "every record on the broker")
    for _ in range(2):
        svc.step()
    svc.close()
    assert (pipe.records_total, source.dead_letters) == (mesh.world * steps, 0)
    [nan] = sink.opened  # nothing else: the pieces' by-design differences are not faults
    assert (nan.kind, nan.first_step, nan.ranks, nan.hosts) == ("nonfinite", bad_step, (bad,), (mesh.host(bad),))
    assert nan.coords == (mesh.coords(bad),) and "at pp=0,dp_replicate=2,tp=1" in nan.message
    pipeline = {mesh.rank_of(tp=t, pp=p, dp=2) for p in range(2) for t in range(2)}
    assert nan.evidence["pipeline_followers"] == sorted(pipeline - {bad})
