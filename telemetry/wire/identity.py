"""A rank's identity from its launcher's environment: run, rank, world, host, mesh coordinates,
and the job key it signs with.

The emitter (and the guard) name every record by the rank that sent it; torchrun and
torch.distributed already say most of it in environment variables, so a training script needs
no arguments. Read once, when an emitter is built: nothing here is on the per-step path.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Mapping

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import Layout, parse_coords
from sdcwatch.core.signing import KEY_ENV, KEY_FILE_ENV, JobKey, job_key_from_env

__all__ = ["identity_from_env", "job_key", "key_for_transport"]

log = logging.getLogger("sdcwatch.telemetry")


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


def job_key(key: Any = None, env: Mapping[str, str] | None = None) -> JobKey | None:
    """The key this rank signs with: ``key`` (a JobKey or ``"kid:secret"``), else the environment's
    (``SDCWATCH_KEY_FILE``, then ``SDCWATCH_KEY``), else None.

    An unusable key raises ConfigError naming where it came from (``key`` or the variable) and
    what is wrong with it, never the secret, and with no chained exception that could show it.
    """
    if isinstance(key, JobKey):
        return key
    if key is not None and not isinstance(key, str):
        raise ConfigError("key", f"must be a JobKey or 'kid:secret', got a {type(key).__name__}")
    env = os.environ if env is None else env
    where = "key" if key is not None else KEY_FILE_ENV if env.get(KEY_FILE_ENV) else KEY_ENV
    try:
        return JobKey.parse(key, "key") if key is not None else job_key_from_env(env)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.problem) from None
    except Exception as exc:  # a key file that is not text, say: its bytes must not reach a log
        raise ConfigError(where, f"cannot read the job key ({type(exc).__name__})") from None


def key_for_transport(key: JobKey | None, transport: Any, *, explicit: bool) -> JobKey | None:
    """Give ``key`` to a transport that signs (one with a ``key`` attribute) and has none; returns
    the key the transport signs with.

    A transport built with its own key keeps it (an explicit, different ``key`` is an error); one
    that cannot sign (``FileTransport``, a transport of the caller's) is said once, by key id.
    """
    if key is None:
        return getattr(transport, "key", None)
    if not hasattr(transport, "key"):
        log.warning("sdcwatch: transport %s does not sign; key %r is not used", type(transport).__name__, key.kid)
        return key
    own = transport.key
    if own is None:
        transport.key = key
        return key
    if explicit and own is not key and own.kid != key.kid:
        raise ConfigError("key", f"key {key.kid!r} given, the transport signs with {own.kid!r}")
    return own
