"""The rank's end of the bus: the emitter, what it holds between sends, its transports, the rank's
environment. Imports no torch (``Emitter.emit`` must stay light); re-exported by :mod:`sdcwatch.telemetry`.
"""
