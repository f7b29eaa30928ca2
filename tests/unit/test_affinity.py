"""Housekeeping CPUs (``dsec.isolation.affinity``): parsing, the masks the C programs take, and pinning every
thread of a process (run in a child process, so this one keeps its mask)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsec.isolation.affinity import control_cpus, cpu_list, hex_mask, parse_cpu_list

NODE = frozenset(os.sched_getaffinity(0))


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), (" 1 , 2 ", {1, 2}),
                                            ("5-5", {5}), ("2,0-1", {0, 1, 2})])
def test_cpu_lists_parse_as_the_kernel_prints_them(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["x", "3-1", "-1", "0-", "1,,2", "0x1", ""])
def test_a_bad_cpu_list_is_refused_with_the_variable_and_the_part_named(text: str) -> None:
    with pytest.raises(ValueError, match=r"DSEC_CONTROL_CPUS=.*is not a CPU number or a range like 0-3"):
        parse_cpu_list(text)


def test_a_huge_range_is_refused_before_it_is_expanded() -> None:
    with pytest.raises(ValueError, match=r"CPU 4000000000 is beyond any machine's \(8192 at most\)"):
        parse_cpu_list("0-4000000000")


def test_cpu_list_round_trips() -> None:
    for cpus in ({0}, {0, 1, 2, 3, 8}, {1, 3, 5}, {0, 1, 63, 64, 65, 200}):
        assert parse_cpu_list(cpu_list(frozenset(cpus))) == cpus
    assert cpu_list(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"


def test_hex_masks_are_what_the_c_programs_parse() -> None:
    assert hex_mask(None) == "-"
    assert hex_mask(frozenset({0, 1})) == "3"
    assert hex_mask(frozenset({4})) == "10"
    assert hex_mask(frozenset({0, 65})) == "2" + "0" * 15 + "1"


def test_control_cpus_are_checked_against_the_cpus_this_process_may_use() -> None:
    assert control_cpus(None) is None
    assert control_cpus("  ") is None
    first = min(NODE)
    assert control_cpus(str(first)) == {first}
    outside = max(NODE) + 1
    with pytest.raises(ValueError, match=rf"CPU {outside} is not one this daemon may run on \(it may use "):
        control_cpus(f"{first},{outside}")


PIN = """
import json, os, threading
from dsec.isolation import affinity
before = threading.Event(); stop = threading.Event()
seen = {}
def early():  # a thread that exists before the pin
    before.set(); stop.wait(); seen["early"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=early); t.start(); before.wait()
node = affinity.pin_control(frozenset({CONTROL}))
late = threading.Thread(target=lambda: seen.__setitem__("late", sorted(os.sched_getaffinity(0))))
late.start(); late.join()
stop.set(); t.join()
seen["main"] = sorted(os.sched_getaffinity(0)); seen["node"] = sorted(node)
seen["sandbox"] = sorted(affinity.sandbox_cpus())
affinity.release()
seen["released"] = sorted(os.sched_getaffinity(0)); seen["after"] = affinity.sandbox_cpus()
print(json.dumps(seen))
"""


def test_pinning_covers_every_thread_and_release_gives_the_node_back() -> None:
    if len(NODE) < 2:
        pytest.skip("needs two CPUs")
    control = min(NODE)
    out = subprocess.run([sys.executable, "-c", PIN.replace("CONTROL", str(control))], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    seen = json.loads(out)
    node = sorted(NODE)
    assert seen == {"early": [control], "late": [control], "main": [control], "node": node, "sandbox": node,
                    "released": node, "after": None}
