"""Parallel coordinates: where a rank sits in the job's device mesh, and which ranks it is like: one
:func:`peer_key` holds the same model piece on other data, one :func:`replica_key` the same parameter
shard (dims, aliases, ``SDCWATCH_MESH`` / ``SDCWATCH_COORDS``: docs/integrations.md). Standard library only.
"""

from __future__ import annotations

from typing import Mapping

from sdcwatch.core.errors import ConfigError

__all__ = [
    "DIMS",
    "DATA_PARALLEL_DIMS",
    "ALIASES",
    "Layout",
    "canonical_dim",
    "check_coords",
    "parse_coords",
    "peer_key",
    "piece_label",
    "replica_key",
    "format_coords",
]

#: The canonical mesh dims, outermost first (see the module docstring).
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")
#: Dims along which ranks hold the same model piece on different data.
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")
#: Other spellings accepted for the canonical dims (layouts, environment, DeviceMesh dim names).
ALIASES = {
    "dp": "dp_replicate",
    "ddp": "dp_replicate",
    "replicate": "dp_replicate",
    "fsdp": "dp_shard",
    "shard": "dp_shard",
    "pipeline": "pp",
    "tensor": "tp",
    "context": "cp",
    "expert": "ep",
}
_INDEX = {d: i for i, d in enumerate(DIMS)}
#: Largest index or size along one dim (the wire carries each coordinate as a u32).
MAX_COORD = 1 << 24


def canonical_dim(name: str, *, key: str = "mesh") -> str:
    """The canonical dim for ``name`` (an alias or a canonical name); ConfigError naming the valid ones."""
    if not isinstance(name, str):
        raise ConfigError(key, f"a mesh dim name must be a string, got {type(name).__name__}")
    n = name.strip().lower()
    if n in _INDEX:
        return n
    if n in ALIASES:
        return ALIASES[n]
    raise ConfigError(
        key,
        f"unknown mesh dim {name!r}: use one of {', '.join(DIMS)} (or {', '.join(sorted(ALIASES))})",
    )


def _pairs(text: str, key: str) -> dict[str, int]:
    """``"tp=2, pp=4"`` -> {"tp": 2, "pp": 4} with canonical dims; ConfigError naming the bad part."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(key, "must be dim=number pairs separated by commas, e.g. 'tp=2,pp=2,dp=4'")
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(key, f"{part.strip()!r} is not dim=number (e.g. 'tp=2,pp=2,dp=4')")
        dim = canonical_dim(name, key=key)
        if dim in out:
            raise ConfigError(key, f"dim {dim!r} given twice")
        try:
            out[dim] = int(value.strip())
        except ValueError:
            raise ConfigError(key, f"{dim}={value.strip()!r}: not a whole number") from None
    return out


def _by_dim(values: Mapping[str, int], key: str, lo: int, hi: int, what: str) -> dict[str, int]:
    """{canonical dim: a whole number in [lo, hi)} in :data:`DIMS` order; ConfigError naming the bad entry."""
    out: dict[str, int] = {}
    for name, value in values.items():
        dim = canonical_dim(name, key=key)
        if dim in out:
            raise ConfigError(key, f"dim {dim!r} given twice")
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < hi:
            raise ConfigError(f"{key}.{dim}", f"{what}, got {value!r}")
        out[dim] = value
    return {d: out[d] for d in DIMS if d in out}


def check_coords(coords: Mapping[str, int], *, key: str = "coords") -> dict[str, int]:
    """Validated canonical coordinates, in :data:`DIMS` order; ConfigError naming the bad entry."""
    if not isinstance(coords, Mapping):
        raise ConfigError(key, f"must be a mapping of mesh dim to index, got {type(coords).__name__}")
    return _by_dim(coords, key, 0, MAX_COORD, f"must be a whole number in [0, {MAX_COORD})")


def parse_coords(text: str, *, key: str = "SDCWATCH_COORDS") -> dict[str, int]:
    """A rank's coordinates from ``"pp=1,dp=3,tp=0"``; ConfigError naming what is wrong."""
    return check_coords(_pairs(text, key), key=key)


class Layout:
    """A job's parallel layout: the size of each mesh dim, ranks numbered over :data:`DIMS` order.

    >>> lay = Layout.parse("tp=2,pp=2,dp=4")
    >>> lay.world, lay.sizes
    (16, {'pp': 2, 'dp_replicate': 4, 'tp': 2})
    >>> lay.coords(5)
    {'pp': 0, 'dp_replicate': 2, 'tp': 1}
    >>> lay.rank_of({'pp': 0, 'dp_replicate': 2, 'tp': 1})
    5
    """

    __slots__ = ("sizes", "world", "_strides")

    def __init__(self, sizes: Mapping[str, int], *, key: str = "layout") -> None:
        self.sizes = _by_dim(sizes, key, 1, MAX_COORD + 1, f"size must be a whole number in [1, {MAX_COORD}]")
        if not self.sizes:
            raise ConfigError(key, "names no dim")
        world, strides = 1, {}
        for d in reversed(tuple(self.sizes)):
            strides[d] = world
            world *= self.sizes[d]
        self.world = world
        self._strides = strides

    @classmethod
    def parse(cls, text: str, *, key: str = "layout") -> "Layout":
        """A layout from ``"tp=2,pp=2,dp=4"`` (order of writing does not matter)."""
        return cls(_pairs(text, key), key=key)

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of global rank ``rank``; ConfigError when it is outside the layout."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ConfigError("rank", f"{rank!r} is outside the layout's {self.world} ranks ({self})")
        return {d: (rank // self._strides[d]) % n for d, n in self.sizes.items()}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The global rank at ``coords`` (every dim of the layout given)."""
        c = check_coords(coords)
        if set(c) != set(self.sizes) or any(c[d] >= n for d, n in self.sizes.items()):
            raise ConfigError("coords", f"{format_coords(c)} is not a rank of the layout {self}")
        return sum(c[d] * self._strides[d] for d in self.sizes)

    def __str__(self) -> str:
        return ",".join(f"{d}={n}" for d, n in self.sizes.items())

    def __repr__(self) -> str:
        return f"Layout({self})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.sizes == self.sizes

    def __hash__(self) -> int:
        return hash(tuple(self.sizes.items()))


def peer_key(coords: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """Ranks holding the same model piece share this key: every coordinate but the data-parallel ones.

    >>> peer_key({'pp': 1, 'dp_replicate': 3, 'tp': 0})
    (('pp', 1), ('tp', 0))
    >>> peer_key({})
    ()
    """
    return tuple((d, coords[d]) for d in DIMS if d in coords and d not in DATA_PARALLEL_DIMS)


def piece_label(coords: Mapping[str, int]) -> str:
    """The model piece a rank holds, as text: its :func:`peer_key` written ``pp=1,tp=0``; empty when
    the peer key is (plain data parallel: one piece). Labels the exporter's per-piece statistics.

    >>> piece_label({'pp': 1, 'dp_replicate': 3, 'tp': 0})
    'pp=1,tp=0'
    >>> piece_label({'dp_replicate': 3})
    ''
    """
    return format_coords(dict(peer_key(coords)))


def replica_key(coords: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """Ranks holding the same parameter shard share this key: the peer key plus ``dp_shard``.

    >>> replica_key({'dp_replicate': 1, 'dp_shard': 0, 'tp': 1})
    (('dp_shard', 0), ('tp', 1))
    """
    return tuple((d, coords[d]) for d in DIMS if d in coords and d != "dp_replicate")


def format_coords(coords: Mapping[str, int]) -> str:
    """``pp=1,dp_replicate=3,tp=0`` in :data:`DIMS` order; empty for no coordinates."""
    return ",".join(f"{d}={coords[d]}" for d in DIMS if d in coords)
