"""Reads of the environment variables that steer moe_route, cheap enough for every call.

The public functions consult the overrides (``MOE_ROUTE_BACKEND``, ``MOE_ROUTE_FINALIZE``,
``MOE_ROUTE_ARCH``, ``MOE_ROUTE_CHECK_IDS``, ``MOE_ROUTE_PERSISTENT``, ``MOE_ROUTE_COMM_SMS``,
``TRITON_INTERPRET``) on every call, so that a change takes effect at once.
``os.environ.get`` encodes the key and decodes the value each time (0.8 µs per read on the
development host, about 4 µs per ``fused_moe`` call); reading the mapping ``os.environ``
keeps underneath (``os.environ._data``, bytes keys on POSIX, updated by every
``os.environ[...] = ...``, ``monkeypatch.setenv``
included) costs 0.05 µs.
"""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None)
_BYTES_KEYS = os.name == "posix" and isinstance(_DATA, dict)


def getenv(name: str, default: str = "") -> str:
    """``os.environ.get(name, default)``, without the per-read encoding where the platform
    allows (POSIX)."""
    if _BYTES_KEYS:
        value = _DATA.get(name.encode())
        return default if value is None else os.fsdecode(value)
    return os.environ.get(name, default)


def flag(name: str) -> bool:
    """A boolean switch: set and not ``""`` / ``"0"``."""
    return getenv(name, "0") not in ("", "0")


def reader(names: tuple[str, ...]):
    """A function returning the values of ``names`` as one hashable tuple, for cache keys (raw:
    bytes or ``None`` on POSIX, read from the mapping without encoding or decoding; ``str`` or
    ``None`` elsewhere)."""
    # (A comprehension calling the mapping's get, not map() over the bound method: Dynamo
    # traces the one and not the other.)
    if _BYTES_KEYS:
        keys, data = tuple(name.encode() for name in names), _DATA
        return lambda: tuple([data.get(key) for key in keys])
    return lambda: tuple([os.environ.get(name) for name in names])


#: SMs the persistent GEMM kernels leave to kernels running beside them (expert parallelism's
#: all-to-alls, overlapped with the experts of another chunk); part of every plan's key.
COMM_SMS_ENV = "MOE_ROUTE_COMM_SMS"


def comm_sms() -> int:
    """``MOE_ROUTE_COMM_SMS`` as an int >= 0 (unset or empty: 0)."""
    value = getenv(COMM_SMS_ENV).strip()
    if not value:
        return 0
    if not value.isdigit():
        raise ValueError(
            f"{COMM_SMS_ENV}={value!r}: expected an integer >= 0 (SMs the persistent GEMM "
            "kernels leave free for communication kernels) or nothing"
        )
    return int(value)
