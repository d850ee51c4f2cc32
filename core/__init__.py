"""The shared leaf: concepts every layer of sdcwatch uses, defined once, each imported from its
module (the errors, the validators, the messages and their codecs, findings and incidents, the
vocabulary, mesh coordinates, Kafka clients). It imports nothing of the project and nothing
heavier than numpy, so the in-rank telemetry, the detectors, the service and the CLI may all use it.
"""
