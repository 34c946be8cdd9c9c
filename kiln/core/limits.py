"""Memory limits read from the environment, this process's resident memory, and how much of
the CPUs other processes take."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Optional

# other processes' share of the CPUs above which a timing (a compile's choice among candidates,
# a machine's calibration) counts as contended: it is cached with how busy the machine was, and a
# later timing on a quieter machine replaces it (a test suite beside a BERT compile made it keep
# the program without attention, 7% slower on a quiet machine)
CONTENDED = 0.25


def contended_share() -> float:
    """The share above which a timing is contended: KILN_CONTENDED (0..1), default CONTENDED. A
    node that is always that busy (a farm node serving traffic) may raise it; 1 counts no
    measurement as contended, however busy the machine was."""
    v = os.environ.get("KILN_CONTENDED", "")
    if not v:
        return CONTENDED
    try:
        share = float(v)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        from kiln.core.errors import InvalidArgument

        raise InvalidArgument(f"KILN_CONTENDED must be a share of the CPUs from 0 to 1, got {v!r}")
    return share


def positive_setting(variable: str, default: float, unit: str) -> float:
    """A positive number from the environment (`unit` names it in the error), else `default`."""
    v = os.environ.get(variable, "")
    try:
        value = float(v) if v else default
    except ValueError:
        value = -1.0
    if not value > 0:
        from kiln.core.errors import InvalidArgument

        raise InvalidArgument(f"{variable} must be a positive number of {unit}, got {v!r}")
    return value


def machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(variable: str, share_of_machine: float) -> int:
    """Bytes: the variable's value in MiB, or this share of the machine's memory when unset."""
    mb = os.environ.get(variable)
    if mb:
        return int(float(mb) * (1 << 20))
    return int(machine_bytes() * share_of_machine)


def resident_bytes() -> int:
    """This process's resident memory now (egglog's e-graph lives in Rust, out of Python's sight)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class CpuLoad:
    """How busy the rest of the machine was since this was made: all CPUs' busy time
    (/proc/stat: user, nice, system, irq, softirq and steal, the last being a VM's neighbours)
    less this process's own CPU time (getrusage), over the wall time the CPUs had. Paired
    ratios absorb a machine that is slower for a while as a whole; they do not absorb another
    process that takes one of two cores from some candidates' runs more than from others'.
    A choice timed, or a machine measured, while that happened is cached with that share, and
    taken again when the machine is quieter (Pipeline.choose, executor_svc.calibrate)."""

    def __init__(self):
        self._start = (time.monotonic(), _busy_seconds(), _own_seconds())  # not the timings' clock

    def others_busy(self) -> float:
        """Others' share of all CPUs' time since construction, 0..1; 0 where /proc/stat is missing."""
        return min(1.0, max(0.0, self.others_share()))

    def others_share(self) -> float:
        """others_busy before it is clamped to 0..1 (a share far outside says the counting is off).
        /proc/stat counts whole clock ticks per CPU, so two ticks per CPU are taken off first:
        over a few milliseconds the count says nothing."""
        wall0, busy0, own0 = self._start
        wall, busy, cpus = time.monotonic() - wall0, _busy_seconds(), os.cpu_count() or 1
        if busy is None or busy0 is None or wall <= 0:
            return 0.0
        others = busy - busy0 - (_own_seconds() - own0) - 2 * cpus / os.sysconf("SC_CLK_TCK")
        return others / (wall * cpus)


def quieter_now(than: float, seconds: float = 0.25) -> bool:
    """Whether other processes take less of the CPUs now (over `seconds`) than `than` and no more
    than contended_share(): a contended timing in the cache is then worth taking again."""
    load = CpuLoad()
    time.sleep(seconds)
    now = load.others_busy()
    return now < than and now <= contended_share()


def _busy_seconds() -> Optional[float]:
    """Seconds all CPUs have spent busy since boot (/proc/stat's first line), None off Linux."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
