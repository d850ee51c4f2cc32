"""The ``[metrics]`` settings of ``sdcwatch serve``: the caps on /metrics' series (``top_k``,
``max_layers``, ``max_pieces``) and where the endpoint listens, their defaults and their checks,
defined once. No prometheus_client here: the configuration reads them on any install."""

from __future__ import annotations

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import check_int, is_host

__all__ = [
    "DEFAULT_TOP_K",
    "DEFAULT_LAYER_STATS",
    "DEFAULT_MAX_LAYERS",
    "DEFAULT_MAX_PIECES",
    "DEFAULT_METRICS_ADDRESS",
    "DEFAULT_METRICS_PORT",
    "check_cardinality",
    "check_address",
    "check_port",
]

#: Ranks exported individually by outlier score, besides those in open incidents (0: only those).
DEFAULT_TOP_K = 16
#: Statistics exported per layer. Per-layer series scale with depth x metrics x stats, so the
#: default keeps three: at 80 layers and 7 layer metrics that is 1,680 series.
DEFAULT_LAYER_STATS: tuple[str, ...] = ("min", "median", "max")
#: (piece, layer) pairs of one run with per-layer series (open-incident layers, then the widest
#: spread); without pipeline or tensor parallelism, layers.
DEFAULT_MAX_LAYERS = 128
#: Pieces of one run with statistics series. A 100,000-rank job laid out ``pp=16, tp=8`` has 128
#: pieces; 32 of them with 9 scalars x 5 statistics are 1,440 series, and per-layer series stay
#: within ``max_layers`` (piece, layer) pairs whatever the number of pieces.
DEFAULT_MAX_PIECES = 32
#: Default address of the service's /metrics endpoint: loopback (beyond the host is a choice).
DEFAULT_METRICS_ADDRESS = "127.0.0.1"
#: Default port of the service's /metrics endpoint.
DEFAULT_METRICS_PORT = 9400


def check_address(address: str) -> None:
    """Raise ConfigError('metrics.address') unless ``address`` is an IP address or a host name."""
    if not isinstance(address, str) or not is_host(address):
        raise ConfigError("metrics.address", f"{address!r} is neither an IP address nor a host name")


def check_port(port: int) -> None:
    """Raise ConfigError('metrics.port') unless ``port`` is an integer in 0-65535 (0: to the server,
    a free port the system picks; to the config, off)."""
    check_int("metrics.port", port, 0, 65535)


def check_cardinality(*, top_k: int, max_layers: int, max_pieces: int) -> None:
    """Raise ConfigError('metrics.<key>') unless each cap on the exported series is an integer in
    range: ``top_k`` at least 0 (with 0, per-rank series exist only for the ranks an open incident
    names: a choice, not a mistake), ``max_layers`` and ``max_pieces`` at least 1 (a run always
    shows its widest layer and piece)."""
    check_int("metrics.top_k", top_k, lo=0)
    check_int("metrics.max_layers", max_layers, lo=1)
    check_int("metrics.max_pieces", max_pieces, lo=1)
