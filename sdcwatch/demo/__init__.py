"""``sdcwatch demo``: the whole product in one command, on a laptop.

It starts the embedded broker, the detector service with its /metrics endpoint, trains the
reference model on 8 simulated data-parallel ranks that stream telemetry through the broker,
injects a fault on one rank part-way through, prints progress and every alert as it fires, and
ends with a summary (what was injected, what was detected, when, which rank) and an HTML report.

Layout: :mod:`~sdcwatch.demo.presets` names the faults, :mod:`~sdcwatch.demo.plan` checks the
settings and places them, :mod:`~sdcwatch.demo.stack` is the detector service beside the job,
:mod:`~sdcwatch.demo.training` the simulated job, :mod:`~sdcwatch.demo.run` runs the whole,
:mod:`~sdcwatch.demo.result` scores and prints it, :mod:`~sdcwatch.demo.command` is the command.
"""

from sdcwatch.demo.command import demo_main
from sdcwatch.demo.presets import PRESETS, preset_faults
from sdcwatch.demo.result import DemoResult, format_summary, summarize
from sdcwatch.demo.run import run_demo
from sdcwatch.demo.training import PACE_LAG_STEPS, PACE_TIMEOUT_S

__all__ = [
    "PRESETS",
    "preset_faults",
    "DemoResult",
    "run_demo",
    "demo_main",
    "summarize",
    "format_summary",
    "PACE_LAG_STEPS",
    "PACE_TIMEOUT_S",
]
