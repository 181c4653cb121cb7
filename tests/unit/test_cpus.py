"""`--workers auto`: the CPUs a process may use, from its affinity mask and its cgroup's CPU quota."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, config_from_args, serve_parser
from proxy.workers.cpus import available_cpus, cgroup_cpu_limit, parse_cfs_quota, parse_cpu_max, resolve_workers

V2_MOUNTS = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)


def _reader(files: dict[str, str]):  # type: ignore[no-untyped-def]
    return files.get


def test_cpu_max_and_cfs_quota_parse() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("garbage") is None
    assert parse_cfs_quota("-1\n", "100000\n") is None
    assert parse_cfs_quota("300000\n", "100000\n") == 3.0
    assert parse_cfs_quota("x", "100000") is None


def test_cgroup_v2_quota_of_the_process_and_its_ancestors() -> None:
    files = {
        "/proc/self/mountinfo": V2_MOUNTS,
        "/proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "/sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "/sys/fs/cgroup/kubepods/pod1/cpu.max": "250000 100000\n",  # the pod's limit binds its container
        "/sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
    }
    assert cgroup_cpu_limit(_reader(files)) == 2.5
    assert available_cpus(_reader(files), affinity=lambda: 8) == 2  # rounded down
    assert available_cpus(_reader(files), affinity=lambda: 1) == 1  # the affinity mask is tighter


def test_cgroup_namespace_root_and_no_limit() -> None:
    files = {"/proc/self/mountinfo": V2_MOUNTS, "/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/cpu.max": "max 100000"}
    assert cgroup_cpu_limit(_reader(files)) is None
    assert available_cpus(_reader(files), affinity=lambda: 4) == 4


def test_cgroup_v1_cfs_quota() -> None:
    files = {
        "/proc/self/mountinfo": V1_MOUNTS,
        "/proc/self/cgroup": "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
        "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
        "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    }
    assert cgroup_cpu_limit(_reader(files)) == 0.5
    assert available_cpus(_reader(files), affinity=lambda: 2) == 1  # never 0


def test_a_cgroup_outside_the_mount_reads_the_mount_root() -> None:
    files = {
        "/proc/self/mountinfo": "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n",
        "/proc/self/cgroup": "2:cpu:/elsewhere\n",
        "/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000",
        "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000",
    }
    assert cgroup_cpu_limit(_reader(files)) == 2.0


def test_nothing_readable_means_the_affinity_mask() -> None:
    assert available_cpus(_reader({}), affinity=lambda: 3) == 3


def test_this_machine_answers_within_its_affinity() -> None:
    import os

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def _workers(argv: list[str], env: dict[str, str] | None = None) -> int:
    args = serve_parser().parse_args(["serve", "--upstream", "http://127.0.0.1:8000", *argv])
    return resolve_workers(config_from_args(args, env or {})).workers


def test_workers_flag_and_variable() -> None:
    assert _workers([]) == 1
    assert _workers(["--workers", "3"]) == 3
    assert _workers([], {"STREAMWARDEN_WORKERS": "2"}) == 2
    assert _workers(["--workers", "4"], {"STREAMWARDEN_WORKERS": "2"}) == 4
    assert _workers(["--workers", "auto"]) == available_cpus()


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "257", ""])
def test_bad_workers_values_name_the_flag(value: str) -> None:
    with pytest.raises(ConfigError, match=r"--workers.*from 1 to 256, or auto"):
        _workers(["--workers", value])
