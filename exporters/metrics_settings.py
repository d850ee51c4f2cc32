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
    "DEFAULT_MAX_HOSTS",
    "DEFAULT_METRICS_ADDRESS",
    "DEFAULT_METRICS_PORT",
    "check_cardinality",
    "check_address",
    "check_port",
]

#: Ranks exported individually by outlier score, besides those in open incidents (0: only those).
DEFAULT_TOP_K = 16
#: Statistics exported per layer (series scale with depth x metrics x stats: 1,680 at 80 x 7).
DEFAULT_LAYER_STATS: tuple[str, ...] = ("min", "median", "max")
#: (piece, layer) pairs of one run with per-layer series (open-incident layers, then the widest spread).
DEFAULT_MAX_LAYERS = 128
#: Pieces of one run with statistics series (32 pieces x 9 scalars x 5 statistics: 1,440 series).
DEFAULT_MAX_PIECES = 32
#: Hosts judged suspect or quarantine with a series of their own, worst first.
DEFAULT_MAX_HOSTS = 50
#: Default address of the service's /metrics endpoint: loopback (beyond the host is a choice).
DEFAULT_METRICS_ADDRESS = "127.0.0.1"
#: Default port of the service's /metrics endpoint.
DEFAULT_METRICS_PORT = 9400


def check_address(address: str) -> None:
    """Raise ConfigError('metrics.address') unless ``address`` is an IP address or a host name."""
    if not isinstance(address, str) or not is_host(address):
        raise ConfigError("metrics.address", f"{address!r} is neither an IP address nor a host name")


def check_port(port: int) -> None:
    """Raise ConfigError('metrics.port') unless ``port`` is an integer in 0-65535."""
    check_int("metrics.port", port, 0, 65535)


def check_cardinality(*, top_k: int, max_layers: int, max_pieces: int) -> None:
    """Raise ConfigError('metrics.<key>') unless ``top_k`` >= 0 (0: only open incidents' ranks) and
    ``max_layers``, ``max_pieces`` >= 1."""
    check_int("metrics.top_k", top_k, lo=0)
    check_int("metrics.max_layers", max_layers, lo=1)
    check_int("metrics.max_pieces", max_pieces, lo=1)
