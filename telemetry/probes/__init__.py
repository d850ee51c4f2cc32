"""The watch and its checks: what ``attach()`` hooks into a model to measure each step
(:mod:`~sdcwatch.telemetry.probes.watch` composes the rest). Modules here import torch; the public
names are re-exported (lazily) by :mod:`sdcwatch.telemetry`.
"""
