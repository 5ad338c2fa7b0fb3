"""ORT's BFC arena replayed (``ho_onnx/target/ort/bfc.py``): the rules it follows, checked
on buffers whose outcome is worked out by hand (against ORT itself:
``test_ort_reuse.py::test_the_replay_takes_a_free_chunk_whole_as_ort_arena_does``)."""

from __future__ import annotations

from ho_onnx.target.ort.bfc import held, in_use

MIB = 1 << 20


def test_requests_are_rounded_to_256_bytes():
    assert list(in_use([(0, 0, 1), (0, 0, 257)], 1)) == [256 + 512]


def test_a_chunk_under_twice_the_request_is_taken_whole():
    # a 9 MiB chunk freed, then an 8 MiB request: all 9 MiB are in use
    assert list(in_use([(0, 0, 9 * MIB), (1, 1, 8 * MIB)], 2)) == [9 * MIB, 9 * MIB]
    # a 16 MiB chunk is split: 8 MiB in use
    assert list(in_use([(0, 0, 16 * MIB), (1, 1, 8 * MIB)], 2)) == [16 * MIB, 8 * MIB]


def test_freed_neighbours_coalesce_within_a_region_only():
    # one 8 MiB region split in 2 + 2 + 4 (free); the second 2 MiB freed joins the free 4:
    # a 5 MiB request takes those 6 MiB whole (under 10): 2 + 6 in use
    region = [(0, 0, 8 * MIB), (1, 2, 2 * MIB), (1, 1, 2 * MIB), (2, 2, 5 * MIB)]
    assert list(in_use(region, 3)) == [8 * MIB, 4 * MIB, 8 * MIB]
    # two 4 MiB regions freed side by side never join: an 8 MiB request grows a third
    apart = [(0, 0, 4 * MIB), (0, 0, 4 * MIB), (1, 1, 8 * MIB), (1, 1, 3 * MIB)]
    assert list(in_use(apart, 2)) == [8 * MIB, 12 * MIB]


def test_a_buffer_is_freed_after_its_last_step_and_empty_ones_take_nothing():
    assert list(in_use([(0, 1, MIB), (1, 1, 0), (2, 2, MIB)], 3)) == [MIB, MIB, MIB]


def test_held_counts_the_regions_grown_by_what_is_requested():
    # two 10 MiB buffers at once, then a 15 MiB one: neither freed 10 MiB region fits it, so
    # the arena holds 35 MiB though never more than 20 are in use
    bufs = [(0, 0, 10 * MIB), (0, 0, 10 * MIB), (1, 1, 15 * MIB)]
    assert list(in_use(bufs, 2)) == [20 * MIB, 15 * MIB]
    assert list(held(bufs, 2)) == [35 * MIB, 35 * MIB]


def test_held_follows_the_power_of_two_growth():
    # kNextPowerOfTwo from 1 MiB: the first 10 MiB request raises the region size to 16 MiB;
    # the second, not raising it, takes another 16 MiB and doubles it for the next; the
    # 15 MiB request then takes a freed 16 MiB chunk whole
    bufs = [(0, 0, 10 * MIB), (0, 0, 10 * MIB), (1, 1, 15 * MIB)]
    assert list(held(bufs, 2, "power_of_two")) == [32 * MIB, 32 * MIB]
    # small requests: regions of 1, 2, 4 MiB as each fills
    small = [(0, 2, MIB), (1, 2, MIB), (2, 2, MIB)]
    assert list(held(small, 3, "power_of_two", runs=1)) == [1 * MIB, 3 * MIB, 3 * MIB]


def test_touched_counts_a_region_up_to_its_last_chunk_handed_out():
    # a 3 MiB request raises the first region to 4 MiB and takes it whole (under twice the
    # request), but only its first 3 MiB are ever written (the pages a CPU process touches)
    bufs = [(0, 0, 3 * MIB), (1, 1, MIB)]
    assert list(held(bufs, 2, "power_of_two")) == [4 * MIB, 4 * MIB]
    assert list(held(bufs, 2, "power_of_two", touched=True)) == [3 * MIB, 3 * MIB]


def test_held_replays_runs_until_one_adds_no_region():
    bufs = [(0, 1, 4 * MIB), (1, 1, 6 * MIB), (2, 2, 9 * MIB)]
    once = held(bufs, 3, runs=1)
    assert list(once) == [4 * MIB, 10 * MIB, 19 * MIB]
    assert list(held(bufs, 3)) == [19 * MIB] * 3  # the second run finds every region
