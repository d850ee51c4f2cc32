"""A rank's identity from its launcher's environment: run, rank, world, host, mesh coordinates.

The emitter (and the guard) name every record by the rank that sent it; torchrun and
torch.distributed already say most of it in environment variables, so a training script needs
no arguments. Read once, when an emitter is built: nothing here is on the per-step path.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import Layout, parse_coords

__all__ = ["identity_from_env"]


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(name, f"must be an integer, got {raw!r}") from None


def identity_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Rank, world size, local rank, host, run and parallel coordinates from launcher variables.

    torchrun/torch.distributed set RANK, WORLD_SIZE and LOCAL_RANK; SDCWATCH_RUN names the run
    (falling back to TORCHELASTIC_RUN_ID, then "default"). The rank's place in the job's device
    mesh (:mod:`sdcwatch.core.mesh`) comes from SDCWATCH_COORDS (``"pp=1,dp=3,tp=0"``) or else from
    SDCWATCH_MESH, the job's layout (``"pp=2,dp=4,tp=2"``) with the rank numbered over it; neither
    set: no coordinates (pure data parallel).
    """
    env = os.environ if env is None else env
    rank = _env_int(env, "RANK", 0)
    world = _env_int(env, "WORLD_SIZE", 1)
    coords: dict[str, int] = {}
    if env.get("SDCWATCH_COORDS"):
        coords = parse_coords(env["SDCWATCH_COORDS"], key="SDCWATCH_COORDS")
    elif env.get("SDCWATCH_MESH"):
        layout = Layout.parse(env["SDCWATCH_MESH"], key="SDCWATCH_MESH")
        if layout.world != world:
            raise ConfigError("SDCWATCH_MESH", f"{layout} has {layout.world} ranks, WORLD_SIZE is {world}")
        coords = layout.coords(rank)
    return {
        "rank": rank,
        "world": world,
        "local_rank": _env_int(env, "LOCAL_RANK", 0),
        "host": env.get("SDCWATCH_HOST") or socket.gethostname(),
        "run": env.get("SDCWATCH_RUN") or env.get("TORCHELASTIC_RUN_ID") or "default",
        "coords": coords,
    }
