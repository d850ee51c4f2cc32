"""The rank's end of the bus: the emitter, its transports, the rank's identity, the end-of-run marker.

Imports no torch: the training loop's one contact with sdcwatch (``Emitter.emit``) must stay light.
The public names are re-exported by :mod:`sdcwatch.telemetry`.
"""
