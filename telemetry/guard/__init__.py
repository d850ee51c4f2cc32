"""The guard: acts on a detection at the step boundary, on every rank alike, without stopping the job.

:mod:`~sdcwatch.telemetry.guard.guard` (``Guard``) judges each step and agrees on an action;
its settings and outcome are :mod:`~sdcwatch.telemetry.guard.config`, the robust checks
:mod:`~sdcwatch.telemetry.guard.checks`, rollback snapshots :mod:`~sdcwatch.telemetry.guard.snapshots`,
decisions read from the control topic :mod:`~sdcwatch.telemetry.guard.control_topic`. The public
names are re-exported (lazily) by :mod:`sdcwatch.telemetry`.
"""
