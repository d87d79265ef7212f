"""header.py: a line split into the kubelet's stamp, vLLM's header fields and the message."""

from __future__ import annotations

from vlm_operator.logs.header import line_seconds, parse_line, split_line

K8S = "2026-11-29T08:22:00.123456789Z "


def test_parse_line_fields():
    ln = parse_line(K8S + "(APIServer pid=11606) ERROR 11-29 07:41:31 [async_llm.py:906] "
                    "AsyncLLM output_handler failed.\r")
    assert (ln.k8s_time, ln.proc, ln.pid, ln.level, ln.time, ln.file, ln.lineno, ln.message,
            ln.continued) == ("2026-11-29T08:22:00.123456789Z", "APIServer", 11606, "ERROR",
                              "11-29 07:41:31", "async_llm.py", 906,
                              "AsyncLLM output_handler failed.", True)
    assert parse_line("INFO:     127.0.0.1:1 - \"GET / HTTP/1.1\" 200 OK") is None
    assert parse_line("(APIServer pid=1) some print output") is None
    empty = parse_line("(APIServer pid=1) INFO 11-29 07:40:52 [utils.py:302] ")
    assert empty.message == ""


def test_split_line_keeps_headerless_process_tag():
    ln = split_line(K8S + "(EngineCore pid=4) Traceback (most recent call last):\r\n")
    assert (ln.proc, ln.pid, ln.level, ln.message, ln.continued) == (
        "EngineCore", 4, None, "Traceback (most recent call last):", True)


def test_line_seconds_from_the_kubelets_stamp_else_vllms_time():
    stamped = split_line(K8S + "(APIServer pid=1) INFO 11-29 07:40:52 [utils.py:302] x")
    assert line_seconds(stamped) == 1795940520.123456
    plain = split_line("INFO 11-29 07:40:52 [utils.py:302] x")
    assert line_seconds(plain) == (((11 * 31 + 29) * 24 + 7) * 60 + 40) * 60 + 52
    assert line_seconds(split_line("no header, no stamp")) is None
