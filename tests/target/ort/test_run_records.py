"""Run-owned records of both engines (csrc/run_records.h), tested with simulated threads.

The CPU engine's failure tests (tests/test_native_safety.py) run this logic through ORT; the
CUDA engine uses the same template with token addresses as keys, which needs a GPU to reach
through ORT. Here every call names its thread and its kernel (the cache op's identity; 0 for
an op's second call into the engine), and threads end when the test says so, so each rule
is checked exactly: a kernel seen twice on a thread starts that thread's next run and
releases its earlier records; a run never uses a record of an earlier run of its own thread;
records of other threads are usable (ORT_PARALLEL) until their thread's next run or end; a
record found at the key of a new one is replaced (a failed run's, at a reused address).
"""

from __future__ import annotations

from native_util import testing_ops

NONE = {"stored": [], "loads": []}


def _records():
    return testing_ops().RunRecords()


def test_a_kernel_seen_twice_starts_the_next_run_and_releases_the_earlier_one():
    r = _records()
    assert r.put_stored(10, name=1, kernel=0xA) == NONE  # run 1: Store A
    assert r.put_load(0x100, name=2, kernel=0xB) == NONE  # run 1: Prefetch B (never waited)
    # The next run's Store A on the same thread: run 1's records are released, and the
    # Prefetch's load is abandoned (its Wait never came).
    assert r.put_stored(11, name=3, kernel=0xA) == {"stored": [1], "loads": [2]}
    assert r.counts() == {"stored": 1, "loads": 0, "abandoned": [2]}
    assert r.find_stored(10, kernel=0xC) == (None, NONE)
    assert r.find_stored(11, kernel=0xD) == (3, NONE)


def test_an_ops_second_call_does_not_start_a_run():
    r = _records()
    r.put_stored(10, name=1, kernel=0xA)
    # A Prefetch of a stored tensor: take_stored enters with its kernel, the load without.
    assert r.find_stored(10, kernel=0xB, take=True) == (1, NONE)
    assert r.put_load(0x100, name=2, kernel=0) == NONE
    assert r.take_load(0x100, kernel=0xC) == (2, NONE)
    assert r.counts() == {"stored": 0, "loads": 0, "abandoned": []}
    # With the kernel given twice, the second call would have ended the run.
    r.put_stored(20, name=3, kernel=0xA)  # (A seen again: run 2 starts)
    r.find_stored(20, kernel=0xB, take=True)
    assert r.put_load(0x200, name=4, kernel=0xB) == NONE  # B again: run 3
    assert r.take_load(0x200, kernel=0xC) == (4, NONE)


def test_a_threads_next_run_releases_every_record_of_its_earlier_runs():
    r = _records()
    r.put_stored(10, name=1, kernel=0xA, thread=1)
    r.put_load(0x100, name=2, kernel=0xB, thread=1)
    # Thread 1 starts its next run with another kernel first: C, then A again.
    r.put_stored(11, name=3, kernel=0xC, thread=1)
    assert r.find_stored(10, kernel=0xD, thread=1) == (1, NONE)  # still run 1 (no repeat)
    released = r.put_stored(12, name=4, kernel=0xA, thread=1)  # A repeats: run 2
    assert released == {"stored": [1, 3], "loads": [2]}
    assert r.take_load(0x100, kernel=0xB, thread=1) == (None, NONE)


def test_records_of_other_threads_are_usable_until_their_next_run():
    r = _records()
    r.put_stored(10, name=1, kernel=0xA, thread=1)
    r.put_load(0x100, name=2, kernel=0xB, thread=1)
    # ORT_PARALLEL: another thread of the same run reloads and waits.
    assert r.find_stored(10, kernel=0xC, thread=2) == (1, NONE)
    assert r.take_load(0x100, kernel=0xD, thread=2) == (2, NONE)
    r.put_stored(11, name=3, kernel=0xA, thread=3)
    r.put_stored(12, name=4, kernel=0xA, thread=3)  # thread 3's next run releases name 3
    assert r.find_stored(11, kernel=0xC, thread=2) == (None, NONE)
    assert r.find_stored(10, kernel=0xE, thread=2) == (1, NONE)  # thread 1 did not move on


def test_records_of_an_ended_thread_are_released_at_any_threads_next_call():
    r = _records()
    r.put_stored(10, name=1, kernel=0xA, thread=7)
    r.put_load(0x100, name=2, kernel=0xB, thread=7)
    r.put_stored(11, name=3, kernel=0xA, thread=8)
    r.end_thread(7)
    r.end_thread(99)  # (a thread that never called: nothing to release)
    assert r.take_load(0x999, kernel=0xC, thread=8) == (None, {"stored": [1], "loads": [2]})
    assert r.counts() == {"stored": 1, "loads": 0, "abandoned": [2]}
    assert r.find_stored(11, kernel=0xD, thread=8) == (3, NONE)


def test_the_accept_check_refuses_a_wrong_tag():
    r = _records()
    r.put_stored(10, name=1, tag=0x5EC2E7, kernel=0xA)
    for tag in (0, 1, 0x5EC2E6):
        assert r.find_stored(10, tag=tag, kernel=0, take=True) == (None, NONE)
    assert r.find_stored(10, tag=0x5EC2E7, kernel=0, take=True) == (1, NONE)
    assert r.find_stored(10, tag=0x5EC2E7, kernel=0, take=True) == (None, NONE)  # taken


def test_a_record_at_a_reused_key_is_replaced():
    r = _records()
    r.put_stored(10, name=1, kernel=0xA, thread=1)  # a failed run's store, never reloaded
    # Another thread's Store gets the same token address: the stale record is released.
    assert r.put_stored(10, name=2, kernel=0xA, thread=2) == {"stored": [1], "loads": []}
    r.put_load(0x100, name=3, kernel=0xB, thread=1)
    assert r.put_load(0x100, name=4, kernel=0xB, thread=2) == {"stored": [], "loads": [3]}
    assert r.counts() == {"stored": 1, "loads": 1, "abandoned": [3]}


def test_drop_load_releases_whatever_waits_at_an_address_without_entering_a_run():
    r = _records()
    r.put_load(0x100, name=1, kernel=0xB, thread=1)
    assert r.drop_load(0x200) == NONE
    assert r.drop_load(0x100) == {"stored": [], "loads": [1]}
    assert r.counts()["abandoned"] == [1]
    # (no run was entered: kernel B on thread 1 is still in its first run)
    r.put_load(0x300, name=2, kernel=0xC, thread=1)
    assert r.take_load(0x300, kernel=0xD, thread=1) == (2, NONE)


def test_move_finds_a_record_and_replaces_a_stale_one_at_the_new_key():
    r = _records()
    r.put_stored(10, name=1, tag=7, kernel=0xA)
    r.put_stored(20, name=2, kernel=0xB, thread=2)  # stale, at the address token2 gets
    assert r.move_stored(10, 30, tag=6, kernel=0) == (None, NONE)  # refused: not moved
    assert r.move_stored(10, 20, tag=7, kernel=0xC) == (1, {"stored": [2], "loads": []})
    assert r.move_stored(10, 30, tag=7, kernel=0) == (None, NONE)  # gone from 10
    assert r.move_stored(20, 20, tag=7, kernel=0) == (1, NONE)  # aliased: stays
    assert r.find_stored(20, tag=7, kernel=0xD) == (1, NONE)
    assert r.counts()["stored"] == 1
    # A record released with its run is not found, nor moved.
    r.put_stored(40, name=3, kernel=0xA, thread=5)
    r.put_stored(41, name=4, kernel=0xA, thread=5)  # thread 5's next run released name 3
    assert r.move_stored(40, 50, kernel=0xE) == (None, NONE)


def test_clear_releases_everything():
    r = _records()
    r.put_stored(10, name=1, kernel=0xA)
    r.put_load(0x100, name=2, kernel=0xB, thread=2)
    assert r.clear() == {"stored": [1], "loads": [2]}
    assert r.counts() == {"stored": 0, "loads": 0, "abandoned": [2]}


def test_a_destroyed_kernel_releases_what_it_made_and_is_forgotten():
    """Issue 34 item 3: a server that makes a session per request never repeats a kernel
    on a thread, so a failed request's records waited for the engine's end (another
    session of the folder kept it) and each thread remembered every kernel it ever ran.
    A kernel's destruction (its session's) releases the records it made, whatever their
    thread, and no thread remembers it; records of other kernels stay."""
    r = _records()
    r.put_stored(10, name=1, kernel=0xA, creator=0xA)  # session 1: Store A
    r.put_load(0x100, name=2, kernel=0xB, creator=0xB)  # session 1: Prefetch B (no Wait)
    r.put_stored(11, name=3, kernel=0xC, creator=0xC, thread=2)  # session 2, running
    assert r.seen() == 3
    assert r.forget(0xA) == {"stored": [1], "loads": []}
    assert r.forget(0xB) == {"stored": [], "loads": [2]}
    assert r.counts() == {"stored": 1, "loads": 0, "abandoned": [2]}
    assert r.seen() == 1
    assert r.find_stored(11, kernel=0, thread=2) == (3, NONE)  # session 2 unaffected
    assert r.forget(0xA) == NONE  # (twice: nothing left)
    # a new session's kernels on thread 1 start no new run: nothing of its own released
    assert r.put_stored(12, name=4, kernel=0xD, creator=0xD) == NONE


def test_a_body_kernel_seen_again_starts_the_next_iteration_not_the_next_run():
    """Cache ops inside a Loop/Scan body (attribute ``iteration`` = 1) execute once per
    iteration: a body kernel seen again releases only the body's records of earlier
    iterations; the main graph's records of the run (a Prefetch issued before the Loop,
    waited after it) stay."""
    r = _records()
    assert r.enter(0xA) == NONE  # main graph: Prefetch A before the Loop
    r.put_load(0x100, name=1, kernel=0)
    for it in range(3):  # the body: Prefetch B, Wait C (a load per iteration)
        released = r.enter(0xB, per_iteration=True)
        assert released == NONE
        r.put_load(0x200 + it, name=10 + it, kernel=0)
        assert r.enter(0xC, per_iteration=True) == NONE
        assert r.take_load(0x200 + it, kernel=0) == (10 + it, NONE)
    assert r.enter(0xD) == NONE  # main graph after the Loop: Wait D takes A's load
    assert r.take_load(0x100, kernel=0) == (1, NONE)
    assert r.counts() == {"stored": 0, "loads": 0, "abandoned": []}


def test_a_failed_iterations_records_go_at_the_next_iteration_and_its_scope_is_kept():
    r = _records()
    r.enter(0xA)
    r.put_stored(10, name=1, kernel=0)  # main graph: a Store before the Loop
    r.enter(0xB, per_iteration=True)
    r.put_load(0x200, name=2, kernel=0)  # iteration 1's Prefetch; its Wait never runs
    # The next iteration (B again): iteration 1's load is released, the main Store stays.
    assert r.enter(0xB, per_iteration=True) == {"stored": [], "loads": [2]}
    assert r.counts()["abandoned"] == [2]
    # A body record is not the main graph's, nor another iteration's, to use.
    r.put_load(0x300, name=3, kernel=0)
    r.enter(0xE)  # back in the main graph (first time: the same run)
    assert r.take_load(0x300, kernel=0) == (None, NONE)
    assert r.find_stored(10, kernel=0) == (1, NONE)  # the main graph's own: usable
    # The body's ops may read what the main graph made in this run.
    r.enter(0xC, per_iteration=True)
    assert r.find_stored(10, kernel=0) == (1, NONE)
    # The main graph's first kernel again: the next run, which releases both scopes.
    assert r.enter(0xA) == {"stored": [1], "loads": [3]}


def test_a_body_only_model_releases_a_failed_runs_records_at_its_next_iteration():
    """With no cache op in the main graph, no kernel starts a run again: the next run's
    first body op starts an iteration, and that releases what the failed run's body left."""
    r = _records()
    r.enter(0xB, per_iteration=True)
    r.put_load(0x200, name=1, kernel=0)  # the failed run stops here
    assert r.enter(0xB, per_iteration=True) == {"stored": [], "loads": [1]}
    assert r.seen() == 1
    assert r.forget(0xB) == NONE
    assert r.seen() == 0
