"""tools/bench/bench_memory.py's accounting: parsing /proc status and smaps_rollup text, the subtractions and verdicts.
Pure functions on texts written here (no process is measured, no threshold on this machine's memory)."""

from __future__ import annotations

import pytest

from tools.bench.bench_memory import (
    MIB,
    Memory,
    beyond,
    heavy_imports,
    memory_of,
    parse_proc_fields,
    per_client_slope,
    verdict,
)

STATUS = """Name:\tpython
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
VmPeak:\t 5000000 kB
VmRSS:\t  700000 kB
RssAnon:\t  300000 kB
RssFile:\t  399000 kB
RssShmem:\t    1000 kB
Threads:\t8
Cpus_allowed_list:\t0-1
"""

ROLLUP = """55d0c0000000-7ffc00000000 ---p 00000000 00:00 0                          [rollup]
Rss:              700000 kB
Pss:              400000 kB
Pss_Anon:         300000 kB
Shared_Clean:     390000 kB
Shared_Dirty:          0 kB
Private_Clean:      9000 kB
Private_Dirty:    301000 kB
Swap:                  0 kB
"""


def test_parse_proc_fields_reads_kb_as_bytes_and_counts_as_they_are() -> None:
    fields = parse_proc_fields(STATUS)
    assert fields["RssAnon"] == 300000 * 1024
    assert fields["VmRSS"] == 700000 * 1024
    assert fields["Threads"] == 8
    assert fields["Tgid"] == 4242
    for skipped in ("Name", "State", "Cpus_allowed_list"):  # not numbers
        assert skipped not in fields
    assert parse_proc_fields("") == {}


def test_parse_proc_fields_skips_the_rollup_header() -> None:
    fields = parse_proc_fields(ROLLUP)
    assert fields["Pss"] == 400000 * 1024
    assert fields["Private_Dirty"] == 301000 * 1024
    assert not any("rollup" in name or "-" in name for name in fields)


def test_memory_of_status_and_rollup() -> None:
    m = memory_of(STATUS, ROLLUP)
    assert m == Memory(rss_anon=300000 * 1024, rss=700000 * 1024, threads=8, uss=310000 * 1024,
                       pss=400000 * 1024)
    alone = memory_of(STATUS)  # smaps_rollup unreadable: no USS/PSS
    assert (alone.uss, alone.pss, alone.rss_anon) == (None, None, 300000 * 1024)
    with pytest.raises(ValueError, match="RssAnon"):
        memory_of("Name:\tkthreadd\nThreads:\t1\n")


def test_beyond_subtracts_baseline_model_and_data() -> None:
    assert beyond(300 * MIB, 280 * MIB, 2 * MIB, 3 * MIB) == 15 * MIB
    assert beyond(100, 90, 20, 0) == -10  # may go below zero (the baseline is another process)


def test_per_client_slope_removes_the_clients_own_model_and_data() -> None:
    # 10 clients: 300 MiB of which 1 MiB model + data; 510 clients: 450 MiB of which 51 MiB theirs:
    # (449 - 299 - 50) / 500 = 0.2 MiB a client.
    slope = per_client_slope(10, 300 * MIB, 1 * MIB, 510, 450 * MIB, 51 * MIB)
    assert slope == pytest.approx(0.2 * MIB)
    # The order of the two hosts does not matter.
    assert per_client_slope(510, 450 * MIB, 51 * MIB, 10, 300 * MIB, 1 * MIB) == pytest.approx(slope)
    with pytest.raises(ValueError):
        per_client_slope(10, 1, 0, 10, 2, 0)


def test_verdict_and_heavy_imports() -> None:
    assert verdict(29.9, 30.0) == "PASS"
    assert verdict(30.0, 30.0) == "PASS"
    assert verdict(30.01, 30.0) == "MISS"
    assert verdict(None, 1.0) == "n/a"
    modules = ["torch", "torch.nn", "matplotlib.pyplot", "PIL.Image", "rayon", "grpc"]
    assert heavy_imports(modules, ("torchvision", "matplotlib", "ray", "PIL")) == ["matplotlib", "PIL"]
    assert heavy_imports([], ("ray",)) == []
