"""In-rank telemetry."""
