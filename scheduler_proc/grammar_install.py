"""Whether structured output can load here: xgrammar's requirements as the installed
packages' metadata lists them, checked at start-up without importing anything, and the
reason a failed load gives each constrained request's 400."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement


def unavailable_reason(exc: Exception) -> str:
    """Why structured output cannot run here, for the log and each constrained request's 400."""
    if isinstance(exc, ImportError):
        missing = (exc.name or "").partition(".")[0]
        if missing and missing != "xgrammar":
            # Installed without its dependencies (``pip install --no-deps``, a wheel copied in).
            return (
                f"structured output needs the xgrammar package, which cannot import its "
                f"dependency {missing!r} ({exc}); install xgrammar with its dependencies "
                f"(`pip install 'xgrammar>=0.1.25'`) and restart"
            )
        return (
            f"structured output needs the xgrammar package, which this server cannot import "
            f"({exc}); install it with `pip install 'xgrammar>=0.1.25'` and restart"
        )
    return f"structured output is unavailable on this server: {type(exc).__name__}: {exc}"


def missing_requirements(distribution: str = "xgrammar") -> list[str]:
    """The requirements of an installed distribution that are not installed themselves
    (all of it when it is missing), read from package metadata without importing anything:
    the scheduler warns at start-up instead of at the first constrained request."""
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return [distribution]
    missing = []
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            missing.append(requirement.name)
    return missing
