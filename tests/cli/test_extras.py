"""The extras pin what the tests run: each user-facing extra's range holds the version the ``dev``
extra pins (the one the tests run), stops before the next major (which no test has run), and the
environment running these tests has the pinned versions installed."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROJECT = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
EXTRAS = {name: [Requirement(r) for r in reqs] for name, reqs in PROJECT["optional-dependencies"].items()}
USER_EXTRAS = sorted(set(EXTRAS) - {"dev"})
#: The extras of training frameworks, whose behaviour the integrations depend on: the tests run one
#: version of each of their packages, pinned in ``dev``.
FRAMEWORK_EXTRAS = ("torch", "hf", "lightning")


def _dev_pins() -> dict[str, Requirement]:
    pins = {}
    for req in EXTRAS["dev"]:
        (spec,) = req.specifier or [None]
        if spec is not None and spec.operator == "==":
            pins[canonicalize_name(req.name)] = req
    return pins


PINS = _dev_pins()


def _ranges() -> list[tuple[str, Requirement]]:
    """(where, requirement) of every range a user installs: the base dependencies and each user-facing extra."""
    out = [("dependencies", Requirement(r)) for r in PROJECT["dependencies"]]
    for extra in USER_EXTRAS:
        out += [(f"[{extra}]", req) for req in EXTRAS[extra] if canonicalize_name(req.name) != "sdcwatch"]
    return out


@pytest.mark.parametrize("where, req", _ranges(), ids=lambda v: str(v))
def test_a_dev_pin_lies_in_the_range_users_get_and_the_range_stops_before_the_next_major(where, req):
    pin = PINS.get(canonicalize_name(req.name))
    if pin is None:
        return  # not pinned: the tests run whatever the range resolves to, as a user's install does
    pinned = Version(next(iter(pin.specifier)).version)
    assert req.specifier.contains(pinned, prereleases=True), f"{where} {req} leaves out {pin}, the version tested"
    next_major = Version(f"{pinned.major + 1}")
    assert not req.specifier.contains(next_major, prereleases=True), (
        f"{where} {req} admits {req.name} {next_major}, a major no test has run (add <{next_major})"
    )


@pytest.mark.parametrize("extra", FRAMEWORK_EXTRAS)
def test_each_package_of_a_framework_extra_is_pinned_for_the_tests(extra):
    unpinned = [str(r) for r in EXTRAS[extra] if canonicalize_name(r.name) not in PINS]
    assert not unpinned, f"[{extra}] has {unpinned} with no dev pin: the tests would run an untested version"


def test_dev_installs_every_user_facing_extra():
    (own,) = [r for r in EXTRAS["dev"] if canonicalize_name(r.name) == "sdcwatch"]
    covered = set(own.extras)
    for extra in list(covered):
        for req in EXTRAS.get(extra, []):
            if canonicalize_name(req.name) == "sdcwatch":
                covered |= req.extras
    assert covered >= set(USER_EXTRAS), f"dev leaves out {sorted(set(USER_EXTRAS) - covered)}"


def test_all_is_everything_a_user_runs():
    (own,) = EXTRAS["all"]
    assert canonicalize_name(own.name) == "sdcwatch" and own.extras == {"service", "broker", "torch"}


@pytest.mark.parametrize("name", sorted(PINS))
def test_the_tests_run_the_pinned_version(name):
    pin = PINS[name]
    if pin.marker is not None and not pin.marker.evaluate({"extra": "dev"}):
        pytest.skip(f"{pin} does not apply to this interpreter")
    try:
        installed = version(pin.name)
    except PackageNotFoundError:
        pytest.fail(f"{pin.name} is not installed: ./dev.sh test installs sdcwatch[dev]")
    assert pin.specifier.contains(installed, prereleases=True), f"{pin.name} {installed} installed, dev pins {pin}"
