"""The rank's environment, read in one place: every variable a training rank honours (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``, ``SDCWATCH_*``) goes into a :class:`RankEnvironment`,
which the emitter, the guard and the probes take instead of ``os.environ`` (a test passes a mapping).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.mesh import Layout, parse_coords
from sdcwatch.core.signing import KEY_ENV, KEY_FILE_ENV, JobKey, job_key_from_env

__all__ = ["RankEnvironment", "identity_from_env", "initialised_cuda"]


def initialised_cuda() -> Any:
    """``torch.cuda`` when the job imported torch and initialised CUDA already, else None: reading
    a GPU's identity never imports torch nor initialises CUDA for it."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:
        return None


@dataclass(frozen=True)
class RankEnvironment:
    """What the environment says to a training rank; :meth:`identity` and :meth:`job_key` parse
    ``variables`` (the raw mapping) on demand (they can fail)."""

    variables: Mapping[str, str] = field(default_factory=dict, repr=False)
    triton: bool = True
    """``SDCWATCH_TRITON`` (default 1): 0 keeps the probes off their Triton kernels."""
    compiled_grad_check: bool = False
    """``SDCWATCH_COMPILED_GRAD_CHECK`` (default 0): 1 checks weight gradients in compiled backwards."""
    wire: str | None = None
    """``SDCWATCH_WIRE``: the emitter's wire format (v1, v2); None: the emitter's default."""
    bootstrap: str | None = None
    """``SDCWATCH_BOOTSTRAP``: the Kafka bootstrap servers the emitter sends to."""
    telemetry_topic: str | None = None
    """``SDCWATCH_BUS_TELEMETRY_TOPIC``: the topic the emitter writes (the one ``sdcwatch serve`` reads)."""

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> "RankEnvironment":
        """Read ``env`` (the process environment when None)."""
        env = dict(os.environ if env is None else env)
        return cls(
            variables=env,
            triton=env.get("SDCWATCH_TRITON", "1") != "0",
            compiled_grad_check=env.get("SDCWATCH_COMPILED_GRAD_CHECK", "0") == "1",
            wire=env.get("SDCWATCH_WIRE") or None,
            bootstrap=env.get("SDCWATCH_BOOTSTRAP") or None,
            telemetry_topic=env.get("SDCWATCH_BUS_TELEMETRY_TOPIC") or None,
        )

    def _int(self, name: str, default: int) -> int:
        raw = self.variables.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(name, f"must be an integer, got {raw!r}") from None

    def identity(self) -> dict[str, Any]:
        """Rank, world size, local rank, host, run (SDCWATCH_RUN, else TORCHELASTIC_RUN_ID, else
        "default") and mesh coordinates: SDCWATCH_COORDS (``"pp=1,dp=3,tp=0"``), else the rank
        numbered over SDCWATCH_MESH (``"pp=2,dp=4,tp=2"``), else none."""
        env = self.variables
        rank, world = self._int("RANK", 0), self._int("WORLD_SIZE", 1)
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
            "local_rank": self._int("LOCAL_RANK", 0),
            "host": env.get("SDCWATCH_HOST") or socket.gethostname(),
            "run": env.get("SDCWATCH_RUN") or env.get("TORCHELASTIC_RUN_ID") or "default",
            "coords": coords,
        }

    def gpu(self, cuda: Any = None, ordinal: int | None = None) -> str:
        """This rank's GPU as its host numbers it: the CUDA_VISIBLE_DEVICES entry of its device
        (``ordinal``, else LOCAL_RANK, else the only one listed; without the variable the ordinal
        itself, when ``cuda`` counts such a device), then ``:`` and the GPU's UUID where ``cuda``
        (an initialised ``torch.cuda``) gives it: ``"5:GPU-8f2e..."``. "" on a CPU rank or unknown."""
        listed = self.variables.get("CUDA_VISIBLE_DEVICES")
        visible = [d.strip() for d in (listed or "").split(",")]
        index = ordinal if ordinal is not None else self._int("LOCAL_RANK", 0)
        if listed is not None and index >= len(visible):
            index = 0 if len(visible) == 1 else -1
        try:
            count = cuda.device_count() if cuda is not None else 0
            uuid = str(getattr(cuda.get_device_properties(index), "uuid", "") or "") if 0 <= index < count else ""
        except Exception:  # a driver that cannot say: the index alone
            count, uuid = 0, ""
        if listed is not None:
            physical = visible[index] if index >= 0 else ""
        else:
            physical = str(index) if 0 <= index < count else ""
        if not physical or physical.startswith("-"):  # "" or "-1": no GPU for this rank
            return ""
        if uuid and not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        return f"{physical}:{uuid}" if uuid and uuid != physical else physical

    def job_key(self, key: Any = None) -> JobKey | None:
        """The key this rank signs with: ``key`` (a JobKey or ``"kid:secret"``), else ``SDCWATCH_KEY_FILE``'s
        (then ``SDCWATCH_KEY``'s), else None. An unusable one: ConfigError naming where, never the secret."""
        if isinstance(key, JobKey):
            return key
        if key is not None and not isinstance(key, str):
            raise ConfigError("key", f"must be a JobKey or 'kid:secret', got a {type(key).__name__}")
        env = self.variables
        where = "key" if key is not None else KEY_FILE_ENV if env.get(KEY_FILE_ENV) else KEY_ENV
        try:
            return JobKey.parse(key, "key") if key is not None else job_key_from_env(env)
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.problem) from None
        except Exception as exc:  # a key file that is not text, say: its bytes must not reach a log
            raise ConfigError(where, f"cannot read the job key ({type(exc).__name__})") from None


def identity_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:meth:`RankEnvironment.identity` of ``env`` (the process environment when None)."""
    return RankEnvironment.read(env).identity()
