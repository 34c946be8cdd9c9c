"""Memory limits read from the environment, and this process's resident memory."""

from __future__ import annotations

import os


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
