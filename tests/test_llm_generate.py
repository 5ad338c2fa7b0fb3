"""bench/llm_generate.py runs and writes well-formed JSON with identical tokens (not timing)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "llm_generate.py"


def _load():
    spec = importlib.util.spec_from_file_location("llm_generate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_quick_run_writes_json_with_identical_tokens(tmp_path):
    out = tmp_path / "llm.json"
    p = _run("--quick", "--workdir", str(tmp_path / "w"), "--json", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["failures"] == []
    cfg = data["config"]
    assert data["contexts"] == [16, 64]
    for ctx in data["contexts"]:
        rows = {r["name"]: r for r in data["rows"] if r["context"] == ctx}
        ref = rows["ort"]
        assert len(ref["tokens"]) == cfg["new_tokens"] + 1
        assert ref["ttft_s"] > 0 and ref["decode_tok_s"] > 0 and ref["rss_delta_bytes"] >= 0
        ho = [r for r in rows.values() if r["name"].startswith("ho ") and not r.get("skipped")]
        assert {"ho floor", "ho 100%"} <= {r["name"] for r in ho}
        for r in ho:
            assert "error" not in r, r
            assert r["tokens_match"] is True and r["tokens"] == ref["tokens"]
            # (sampled at the library's Waits: none when the plan moves nothing per run)
            assert r["budget_bytes"] > 0, r
            assert r["arena_max_in_use"] is not None or not r["loaded_bytes_per_run"], r
        # The floor row offloads: the library loads weights at every run.
        assert rows["ho floor"]["loaded_bytes_per_run"] > 0
        kv = rows["ho weights+KV floor"]
        assert ("skipped" in kv) != _load().kv_offload_supported()
        for name in ("hf", "hf offloaded"):
            assert "skipped" in rows[name] or len(rows[name]["tokens"]) == cfg["new_tokens"] + 1
        assert "offload" in rows["hf offloaded"]["skipped"]  # (CPU: nowhere to offload to)
    assert "reference" in p.stdout and "= ort" in p.stdout


def test_a_token_mismatch_fails_loudly(tmp_path, monkeypatch, capsys):
    """A row whose tokens differ from ort's is a failure (exit 1, no numbers), not a row."""
    mod = _load()
    real = mod.run_child

    def altered(argv, timeout):
        res = real(argv, timeout)
        if "--optimized" in argv and "tokens" in res:
            res["tokens"] = [(res["tokens"][0] + 1) % 256, *res["tokens"][1:]]
        return res

    monkeypatch.setattr(mod, "run_child", altered)
    out = tmp_path / "llm.json"
    rc = mod.main(["--quick", "--no-hf", "--contexts", "16", "--workdir", str(tmp_path / "w"),
                   "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    assert "TOKEN MISMATCH" in text and "TOKENS DIFFER FROM ort: no numbers" in text
    data = json.loads(out.read_text())
    assert data["failures"] and all(r["tokens_match"] is False for r in data["rows"]
                                    if r["name"].startswith("ho ") and "tokens" in r)


@pytest.mark.parametrize(("argv", "message"), [
    (["--contexts", "0"], "must be positive"),
    (["--budgets", "1.5"], "fractions in (0, 1]"),
    (["--device", "cuda"], "cannot run on cuda here"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, argv, message):
    if argv == ["--device", "cuda"] and _load().preflight("cuda") is None:
        pytest.skip("this machine can run the CUDA bench")
    p = _run("--quick", "--no-hf", "--workdir", str(tmp_path), *argv)
    assert p.returncode == 2
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing built


def test_long_context_chunk_keeps_attention_under_int32_elements():
    """On the H200 (stop 46) ORT's CUDA Add failed at 32k context with 2,048-token chunks
    (32 heads x 2,048 x 34,831 scores > 2**31: fast_divmod); the bench halves the chunk there
    and keeps the configured one where it fits."""
    mod = _load()
    cfg = dict(mod.PRESETS["cuda"])
    assert mod.context_chunk(cfg, 2048) == cfg["chunk"] == 2048
    c = mod.context_chunk(cfg, 32768)
    assert c == 1024
    assert cfg["heads"] * c * (32768 + cfg["new_tokens"] + c) <= 2**31 - 1
    assert cfg["heads"] * 2 * c * (32768 + cfg["new_tokens"] + 2 * c) > 2**31 - 1
