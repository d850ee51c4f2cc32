"""A torch ``DeviceMesh`` read as this rank's parallel coordinates (the record's ``coords``), its dims
mapped to the canonical ones of :mod:`sdcwatch.core.mesh` (a plain ``dp`` is ``dp_shard`` under FSDP2,
``dp_replicate`` otherwise). Reads the mesh's attributes only: no torch import.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import ALIASES, DIMS, check_coords

__all__ = ["coords_from_mesh"]


def coords_from_mesh(
    device_mesh: Any, names: Mapping[str, str] | Sequence[str] | None = None, *, sharded: bool = False
) -> dict[str, int]:
    """This rank's coordinates in ``device_mesh`` as ``{canonical dim: index}``, in :data:`DIMS` order.
    ``names``: {mesh dim: canonical dim} overriding the built-in spellings, or one canonical name per
    dim (a mesh without ``mesh_dim_names``); ``sharded``: FSDP2 shards over a plain ``dp`` dim.
    """
    try:
        shape = tuple(int(s) for s in device_mesh.shape)
        coordinate = device_mesh.get_coordinate()
        dim_names = device_mesh.mesh_dim_names
    except AttributeError:
        raise ConfigError("mesh", f"needs a torch DeviceMesh, got {type(device_mesh).__name__}") from None
    if coordinate is None:
        raise ConfigError("mesh", f"this rank is not part of the mesh {_describe(dim_names, shape)}")
    if names is not None and not isinstance(names, Mapping):
        if isinstance(names, str) or len(names) != len(shape):
            raise ConfigError("mesh.names", f"needs one canonical name per mesh dim ({len(shape)}), got {names!r}")
        canonical = [_canonical(str(n), {}, where="mesh.names") for n in names]
    elif dim_names is None:
        raise ConfigError(
            "mesh",
            f"the mesh {_describe(None, shape)} has no dim names: build it with mesh_dim_names=(...) "
            f"or pass names=[...] with one of {', '.join(DIMS)} per dim",
        )
    else:
        overrides = dict(names or {})
        unused = sorted(set(overrides) - set(dim_names))
        if unused:
            raise ConfigError("mesh.names", f"{unused[0]!r} is not a dim of the mesh {_describe(dim_names, shape)}")
        canonical = [_canonical(n, overrides, where="mesh") for n in dim_names]
    if "dp" in canonical:  # the shards' dim when nothing else is (HSDP's other dim makes it the replicas')
        plain = "dp_shard" if sharded and "dp_shard" not in canonical else "dp_replicate"
        canonical = [plain if d == "dp" else d for d in canonical]
    coords: dict[str, int] = {}
    for dim, index, size in zip(canonical, coordinate, shape):
        coords[dim] = coords.get(dim, 0) * size + int(index)
    return check_coords(coords, key="mesh")


def _canonical(name: str, overrides: Mapping[str, str], *, where: str) -> str:
    target = overrides.get(name, name)
    if target == "dp":  # the one alias whose meaning depends on the model: resolved by the caller
        return "dp"
    if target in DIMS:
        return target
    if target in ALIASES:
        return ALIASES[target]
    if name in overrides:
        raise ConfigError(f"{where}.{name}", f"maps to {target!r}, which is none of {', '.join(DIMS)}")
    raise ConfigError(
        f"{where}.{name}",
        f"mesh dim {name!r} is not a parallel dimension sdcwatch knows ({', '.join(DIMS)}, or "
        f"{', '.join(sorted(ALIASES))}): pass mesh_names={{{name!r}: 'tp'}} (or whichever it is) to attach",
    )


def _describe(dim_names: Sequence[str] | None, shape: tuple[int, ...]) -> str:
    if dim_names is None:
        return "x".join(str(s) for s in shape)
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(dim_names, shape)) + ")"
