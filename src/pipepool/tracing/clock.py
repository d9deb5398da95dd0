"""Aligning another process's clock with the driver's.

Processes on the driver's host read the same CLOCK_MONOTONIC: their offset is exactly 0, and
estimating one would only add error. A process on another host answers a few pings; each
gives the remote clock at some instant between the ping's send and the answer's arrival on
the driver; the ping with the shortest round trip bounds the error best (NTP's rule), to half
of that round trip.
"""

from __future__ import annotations

PING_ROUNDS = 8


def estimate_offset(samples: list[tuple[int, int, int]]) -> tuple[int, int]:
    """``samples``: (driver time sent, remote time, driver time received), ns.
    Returns (offset, error bound): add the offset to a remote time to read the driver's clock."""
    sent, remote, received = min(samples, key=lambda s: s[2] - s[0])
    return (sent + received) // 2 - remote, (received - sent) // 2


def offset_for(driver_host: str, remote_host: str, samples: list[tuple[int, int, int]]) -> int:
    if remote_host == driver_host:
        return 0
    return estimate_offset(samples)[0]
