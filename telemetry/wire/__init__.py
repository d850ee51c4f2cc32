"""The rank's end of the bus: the emitter, what it holds between sends, its transports, the rank's environment.

Imports no torch: the training loop's one contact with sdcwatch (``Emitter.emit``) must stay light.
The public names are re-exported by :mod:`sdcwatch.telemetry`.
"""
