"""Named probe configurations, so a detection number and a cost number describe the same one (the
campaign and the benchmarks take these names, or a JSON/TOML file of :class:`ProbeConfig` fields).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sdcwatch.core.errors import ConfigError
from sdcwatch.core.validate import settings_from
from sdcwatch.telemetry.probes.config import ProbeConfig

__all__ = ["PROBE_PRESETS", "probe_config"]

_OFF = 1 << 30
PROBE_PRESETS: dict[str, ProbeConfig] = {
    "default": ProbeConfig(),
    "forward-checksums": ProbeConfig(checksum_forward_every=1),
    "checksums": ProbeConfig(checksum_every=1),
    "every-step": ProbeConfig(
        attention_every=1, activations_every=1, fingerprint_every=1, canary_every=10, checksum_every=1
    ),
    "scalars-only": ProbeConfig(
        attention_every=_OFF,
        fingerprint_every=_OFF,
        activations_every=0,
        checksum_every=0,
        stream_every=0,
        gemm_canary_every=0,
    ),
}


def probe_config(spec: str | ProbeConfig) -> tuple[str, ProbeConfig]:
    """(name, config) of a preset name or a JSON/TOML file of ProbeConfig fields."""
    if isinstance(spec, ProbeConfig):
        return "custom", spec
    if spec in PROBE_PRESETS:
        return spec, PROBE_PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError("probes", f"{spec!r} is neither a preset ({', '.join(PROBE_PRESETS)}) nor a file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: the tomli backport (a dependency there)
                import tomli as tomllib

            data: Any = tomllib.loads(text)
            data = data.get("probes", data)
        else:
            data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            "probes", f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError("probes", f"{path}: must hold an object of probe settings")
    return path.stem, settings_from(ProbeConfig, "probes", data, where=str(path))
