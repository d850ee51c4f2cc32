"""The watch and its checks: what ``attach()`` hooks into a model to measure each step.

:mod:`~sdcwatch.telemetry.probes.watch` (``attach``, ``Watch``) composes the rest: gradient statistics,
attention statistics, activations, the matrix checksums and their bounds, the residual-stream scan,
the per-product canary, fingerprints, the device-to-host hand-off, and the probe settings and
presets. Modules here import torch; the public names are re-exported (lazily) by
:mod:`sdcwatch.telemetry`.
"""
