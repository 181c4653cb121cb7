"""`--workers auto`: the CPUs this process may really use, not the CPUs the machine has.

In a container `os.cpu_count()` is the node's count; what bounds the process is its affinity mask
(cpusets, `taskset`) and the cgroup CPU quota (a Kubernetes CPU limit): cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, on the process's own cgroup and every ancestor up to the
mount's root (a parent's limit binds the child too). A fractional quota is rounded down, at least 1,
as uber-go/automaxprocs does: a worker that cannot get a whole CPU is throttled in 100 ms periods,
which shows as latency spikes rather than throughput.

The parsing is plain functions over text; the file reads are behind one `read` callable so that a
test can hand in a fake /proc and /sys.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Callable
from dataclasses import replace

from proxy.config import AUTO_WORKERS, Config

__all__ = ["available_cpus", "cgroup_cpu_limit", "parse_cfs_quota", "parse_cpu_max", "resolve_workers"]

Reader = Callable[[str], str | None]


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("max 100000" or "150000 100000") -> CPUs, None when unlimited."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1: unlimited) and `cpu.cfs_period_us` -> CPUs, None when unlimited."""
    try:
        quota, period = int(quota_text.strip()), int(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read_file(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _cpu_mounts(mountinfo: str) -> list[tuple[str, str, int]]:
    """(mount root, mount point, cgroup version) of the cgroup2 mount and the v1 mounts carrying `cpu`."""
    found: list[tuple[str, str, int]] = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.append((fields[3], fields[4], 2))
        elif tail[0] == "cgroup" and "cpu" in tail[2].split(","):
            found.append((fields[3], fields[4], 1))
    return found


def _own_paths(proc_cgroup: str) -> dict[int, str]:
    """The process's cgroup path for v2 (`0::/path`) and for the v1 hierarchy that has `cpu`."""
    paths: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths[2] = parts[2]
        elif "cpu" in parts[1].split(","):
            paths[1] = parts[2]
    return paths


def _levels(mount_root: str, mount_point: str, path: str) -> list[str]:
    """The directories from the process's cgroup up to the mount point."""
    rel = posixpath.relpath(path, mount_root) if path.startswith(mount_root) else "."
    here = posixpath.normpath(posixpath.join(mount_point, rel))
    if rel.startswith(".."):  # the cgroup is outside what this mount shows (a cgroup namespace)
        here = mount_point
    levels = [here]
    while here != mount_point and here.startswith(mount_point):
        here = posixpath.dirname(here)
        levels.append(here)
    return levels


def cgroup_cpu_limit(read: Reader = _read_file) -> float | None:
    """The tightest CPU quota on this process's cgroup and its ancestors, in CPUs; None when there is none."""
    mountinfo, proc_cgroup = read("/proc/self/mountinfo"), read("/proc/self/cgroup")
    if mountinfo is None or proc_cgroup is None:
        return None
    paths = _own_paths(proc_cgroup)
    limits: list[float] = []
    for root, point, version in _cpu_mounts(mountinfo):
        if version not in paths:
            continue
        for level in _levels(root, point, paths[version]):
            if version == 2:
                text = read(posixpath.join(level, "cpu.max"))
                limit = parse_cpu_max(text) if text is not None else None
            else:
                quota, period = read(posixpath.join(level, "cpu.cfs_quota_us")), read(
                    posixpath.join(level, "cpu.cfs_period_us"))
                limit = parse_cfs_quota(quota, period) if quota is not None and period is not None else None
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def available_cpus(read: Reader = _read_file, affinity: Callable[[], int] = _affinity) -> int:
    """min(affinity mask, cgroup quota rounded down), at least 1."""
    cpus = affinity()
    limit = cgroup_cpu_limit(read)
    if limit is not None:
        cpus = min(cpus, math.floor(limit))
    return max(1, cpus)


def resolve_workers(config: Config) -> Config:
    """`--workers auto` becomes the CPUs this process may use; any other count stays as given."""
    return replace(config, workers=available_cpus()) if config.workers == AUTO_WORKERS else config
