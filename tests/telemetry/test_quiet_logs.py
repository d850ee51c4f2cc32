"""Quiet, honest logs: with the documented ``logging.basicConfig(level=logging.INFO)``, a job's log
carries sdcwatch's lines and no INFO chatter of the Kafka client (its logger at WARNING, set where
sdcwatch builds its clients), unless the application set the ``kafka`` logger's level itself."""

from __future__ import annotations

import logging

import pytest
from sdcwatch.telemetry import Emitter

pytestmark = pytest.mark.integration


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kafka_logger():
    """The ``kafka`` logger as an application finds it (level unset), put back as it was after."""
    kafka_log = logging.getLogger("kafka")
    was = kafka_log.level
    kafka_log.setLevel(logging.NOTSET)
    yield kafka_log
    kafka_log.setLevel(was)


def _job_log(bootstrap: str, topic: str) -> list[logging.LogRecord]:
    """What a root handler at INFO (as basicConfig(level=INFO) sets up) gets from a four-rank job."""
    root, caught = logging.getLogger(), _Caught()
    level = root.level
    root.addHandler(caught)
    root.setLevel(logging.INFO)
    try:
        emitters = [Emitter(run="quiet", rank=r, world=4, bootstrap=bootstrap, topic=topic) for r in range(4)]
        for step in range(30):
            for em in emitters:
                em.emit(step, loss=2.0, grad_norm=1.0)
        for em in emitters:
            em.close()
            assert em.sent == 30
    finally:
        root.removeHandler(caught)
        root.setLevel(level)
    return caught.records


def _from(records: list[logging.LogRecord], package: str, below: int) -> list[str]:
    return [r.getMessage() for r in records if r.name.split(".")[0] == package and r.levelno < below]


def test_at_info_the_kafka_client_says_nothing_below_warning(bootstrap, unique_topic, kafka_logger):
    records = _job_log(bootstrap, unique_topic)
    assert kafka_logger.level == logging.WARNING
    assert _from(records, "kafka", logging.WARNING) == []


def test_a_kafka_level_the_application_set_is_kept_and_its_lines_come_back(bootstrap, unique_topic, kafka_logger):
    kafka_logger.setLevel(logging.INFO)  # the documented way to get the Kafka client's lines back
    records = _job_log(bootstrap, unique_topic)
    assert kafka_logger.level == logging.INFO
    assert len(_from(records, "kafka", logging.WARNING)) >= 4  # at least a connection line per rank
