"""Ray Serve (ho_onnx.target.ort.ray_serve): an optimized model served over HTTP by two
replica processes on localhost. Marked ``serve``: scripts/test.sh runs it as its own
bounded stage (a local Ray cluster takes ~30 s to start); skipped without ray[serve]."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from graphs import save, two_weights_model

import ho_onnx
from ho_onnx import OffloadOptions

pytestmark = pytest.mark.serve
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ho_onnx.target.ort.ray_serve import deployment, pack, replica_stats, unpack  # noqa: E402

REPLICAS = 2
BUDGET = 1_500_000  # bytes: the planner offloads both 1 MiB weights to fit
DEADLINE_S = 240  # the whole module's bound (start, requests, a replica's replacement)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    d = tmp_path_factory.mktemp("serve")
    src = save(two_weights_model(), d / "m.onnx")
    out = d / "opt" / "m.ho.onnx"
    # (whole weights, max_blocks=0: the checks below count the two of them)
    r = ho_onnx.optimize(src, out, OffloadOptions(budget=BUDGET, min_bytes=0, max_blocks=0))
    assert len(r.choice.weights) == 2 and r.plan is not None
    return src, out, r


@pytest.fixture(scope="module")
def url(models) -> Any:
    """A local Ray cluster with the optimized model served at ``<url>``."""
    port = _free_port()
    ray.init(num_cpus=REPLICAS + 1, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 << 20)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(models[1], optimized=True, replicas=REPLICAS, sample_arena=True,
                             host_pool_limit=64 << 20), name="opt", route_prefix="/opt")
        yield f"http://127.0.0.1:{port}/opt"
    finally:
        serve.shutdown()
        ray.shutdown()


def _post(url: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    req = urllib.request.Request(url, data=pack(feeds), method="POST",
                                 headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return unpack(r.read())


def _inputs(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((8, 512)).astype(np.float32)}


@pytest.fixture(scope="module")
def expected(models) -> Any:
    """The unmodified model's answer for a seed (prepacking off: the same MatMul kernel)."""
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(models[0]), so, providers=["CPUExecutionProvider"])
    return lambda seed: sess.run(None, _inputs(seed))[0]


class _Load:
    """``clients`` threads sending requests until stopped; a failed request (a replica that
    died under it) is retried; every answer is compared with the unmodified model's."""

    def __init__(self, url: str, expected: Any, clients: int) -> None:
        self.url, self.expected = url, expected
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.ok = self.wrong = self.failed = 0
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            seed = 1000 * i + n % 8
            n += 1
            for _ in range(20):
                try:
                    got = _post(self.url, _inputs(seed))["y"]
                    break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    with self.lock:
                        self.failed += 1
                    time.sleep(0.2)
            else:
                return
            same = np.array_equal(got, self.expected(seed))
            with self.lock:
                self.ok += same
                self.wrong += not same

    def __enter__(self) -> _Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def test_concurrent_requests_equal_the_unmodified_model(url, expected, models):
    start = time.monotonic()
    with _Load(url, expected, clients=6) as load:
        while load.ok + load.wrong < 60 and time.monotonic() - start < DEADLINE_S / 4:
            time.sleep(0.2)
    assert load.wrong == 0 and load.ok >= 60, (load.ok, load.wrong, load.failed)
    assert load.failed == 0
    # Both replicas answered, each within its budget: one run at a time, its ORT arena
    # peak (sampled at every Wait) within the plan's budget; the host store holds the two
    # offloaded weights.
    stats = replica_stats(url)
    assert len(stats) == REPLICAS, stats.keys()
    for c in stats.values():
        assert c["prefetches"] > 0 and c["waits"] > 0
        assert 0 < c["ort_arena_max_in_use"] <= BUDGET, c["ort_arena_max_in_use"]
        assert c["host_store_bytes"] == 2 * 512 * 512 * 4
        assert c["host_pool_bytes_reserved"] <= 64 << 20


def test_a_replica_killed_under_load_is_replaced(url, expected):
    before = set(replica_stats(url))
    assert len(before) == REPLICAS
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if "SERVE_REPLICA" in a["name"]]
    assert len(names) == REPLICAS, names
    start = time.monotonic()
    with _Load(url, expected, clients=4) as load:
        time.sleep(1.0)
        victim = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
        ray.kill(victim, no_restart=True)
        after: set[int] = set()
        while time.monotonic() - start < DEADLINE_S / 2:
            after = set(replica_stats(url, tries=16))
            if len(after) == REPLICAS and len(after & before) == 1:
                break
            time.sleep(1.0)
        done = load.ok
        time.sleep(1.0)  # the new replica serves too
    assert len(after) == REPLICAS and len(after & before) == 1, (before, after)
    assert load.wrong == 0, (load.ok, load.wrong, load.failed)
    assert load.ok > done > 0
