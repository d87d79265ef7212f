"""Reading pods' /metrics: only the named samples are parsed, with the same values a full parse
gives, from a real vLLM 0.32.0 /metrics and from the stand-ins that serve it."""

import socket
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vlm_operator.api import names
from vlm_operator.autoscaling.autoscaler import metric_names
from vlm_operator.podreads import reader
from vlm_operator.stalls.verdicts import PROGRESS_METRICS
from vlm_testbed import vllmsim

REAL = vllmsim.REAL_METRICS.read_text()


def full_parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def test_named_samples_match_a_full_parse_of_a_real_vllm_metrics_page():
    everything = full_parse(REAL)
    assert len(everything) > 100  # buckets, process and GC families: what is skipped
    names = {*PROGRESS_METRICS, *metric_names({"autoscaling": {
        "metric": "vllm:num_requests_waiting"}})}
    assert names <= set(everything)
    assert reader.parse_metrics(REAL, names) == {n: everything[n] for n in names}
    assert reader.parse_metrics(REAL, names)["vllm:request_success_total"] == 5.0  # 5 reasons


@pytest.mark.parametrize("name", ["vllm:request_success", "vllm:request_success_total_x",
                                  "vllm:e2e_request_latency_seconds", "process_open"])
def test_a_name_is_exact_not_a_prefix(name):
    assert reader.parse_metrics(REAL, {name}) == {}


def test_every_sample_of_the_real_page_reads_as_in_a_full_parse():
    everything = full_parse(REAL)
    for name, value in everything.items():
        assert reader.parse_metrics(REAL, {name}) == {name: value}, name


def test_the_stand_ins_serve_the_real_families_they_do_not_simulate():
    light = vllmsim.render_metrics('engine="0",model_name="m"',
                                   dict.fromkeys(vllmsim.GAUGES, 3.0), {}, {},
                                   vllmsim.real_families(frozenset(vllmsim.GAUGES), "m"))
    values = full_parse(light)
    assert 'model_name="tiny"' not in light and 'model_name="m"' in light
    assert values["vllm:num_requests_waiting"] == 3.0  # simulated, not the real page's 0
    assert values["vllm:request_success_total"] == 5.0  # the real page's
    assert values["process_open_fds"] > 0
    assert light.count("# HELP vllm:num_requests_waiting ") == 1


def test_the_scraper_reads_the_named_samples_of_each_pod():
    server = vllmsim.page_server(REAL.encode(), "127.0.0.2")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    old = names.PORT
    names.PORT = port
    scraper = reader.Scraper(workers=4)
    try:
        pods = [{"metadata": {"name": "a", "uid": "1"}, "status": {"podIP": "127.0.0.2"}},
                {"metadata": {"name": "b", "uid": "2"}, "status": {}}]
        out = scraper.scrape(("team", "m"), pods, PROGRESS_METRICS)
    finally:
        names.PORT = old
        scraper.stop()
        server.shutdown()
    assert out["a"].values == {n: full_parse(REAL)[n] for n in PROGRESS_METRICS}
    assert out["b"] == reader.Scrape(error="no-ip")


def test_samples_with_and_without_labels_and_any_blank_are_summed():
    text = 'vllm:a\t3\nvllm:ab 4\nvllm:a{x="1"} 2\n# HELP vllm:a not a sample 9\n'
    assert reader.parse_metrics(text, {"vllm:a"}) == {"vllm:a": 5.0}


@pytest.mark.parametrize("line, value", [
    ('vllm:a{x="a } b",y="q\\"} 7"} 2', 2.0),  # '}', an escaped quote and blanks in values
    ('vllm:a{x="\\\\"} 3 1700000000000', 3.0),  # an escaped backslash; a timestamp
    ('vllm:a{} +Inf', float("inf")),
    ('vllm:a 4\r', 4.0),
])
def test_label_values_may_hold_anything_escaped(line, value):
    assert reader.parse_metrics(line + "\n", {"vllm:a"}) == {"vllm:a": value}


@pytest.mark.parametrize("line", [
    'vllm:a{x="1} 2',  # a value never closed
    'vllm:a{x="1"}2',  # no blank before the value
    'vllm:a{x="1"} 2}',  # a brace after the value
    'vllm:a{x="1"} 2 3.5',  # a timestamp that is not an integer
    'vllm:a 1 2 3',
    'vllm:a{x="1"} ',
    'vllm:a x',
])
def test_a_wanted_line_that_is_not_a_sample_is_an_error(line):
    with pytest.raises(ValueError, match="not a sample line"):
        reader.parse_metrics(line + "\n", {"vllm:a"})


class CountingLabels:
    """Stands in for reader._LABELS: counts the label sets matched and their bytes."""

    def __init__(self, monkeypatch):
        self.calls, self.longest = 0, 0
        self.real = getattr(reader, "_LABELS", None)
        monkeypatch.setattr(reader, "_LABELS", self, raising=False)

    def fullmatch(self, text):
        self.calls += 1
        self.longest = max(self.longest, len(text))
        return self.real.fullmatch(text)


def test_a_wanted_line_over_the_cap_is_refused_before_its_content_is_matched(monkeypatch):
    """A pod's page may hold a wanted line up to the whole answer (2 MiB); past LINE_CAP bytes
    it is refused as it is, its label set never matched, however well formed."""
    counting = CountingLabels(monkeypatch)
    labels = '{x="' + "v" * (reader.LINE_CAP - len('vllm:a{x=""} 1')) + '"}'
    at_cap = f"vllm:a{labels} 1"
    assert len(at_cap) == reader.LINE_CAP
    assert reader.parse_metrics(at_cap + "\n", {"vllm:a"}) == {"vllm:a": 1.0}
    assert counting.calls == 1
    for over in (f"vllm:a{labels}  1", f"vllm:a{labels}  1\n"):  # one byte more, last or not
        with pytest.raises(ValueError, match=f"longer than {reader.LINE_CAP} bytes"):
            reader.parse_metrics(over, {"vllm:a"})
    assert counting.calls == 1


def hostile_page(shape: str) -> bytes:
    """Pages at the byte cap whose wanted lines cost a backtracking parser the most."""
    cap, name = reader.METRICS_CAP, b"vllm:num_requests_running"
    line = reader.LINE_CAP - len(name) - 10
    lines = cap // reader.LINE_CAP
    return {
        "one line, a value never closed": lambda: name + b'{a="' + b"x" * cap,
        "one line, empty labels": lambda: name + b"{" + b'a="",' * (cap // 5) + b"} 1",
        "lines at the cap, a value never closed": lambda: (
            name + b'{a="' + b"x" * line + b"\n") * lines,
        "lines at the cap, escapes": lambda: (
            name + b'{a="' + b"\\x" * (line // 2) + b'"} 1\n') * lines,
        "lines at the cap, empty labels": lambda: (
            name + b"{" + b'a="",' * (line // 5) + b"} 1\n") * lines,
        "most lines": lambda: (name + b'{a="1"} 1\n') * reader.MAX_SAMPLE_LINES,
        "one line too many": lambda: (name + b'{a="1"} 1\n') * (reader.MAX_SAMPLE_LINES + 1),
    }[shape]()


@pytest.mark.parametrize("shape, read", [
    ("one line, a value never closed", "longer than"),
    ("one line, empty labels", "longer than"),
    ("lines at the cap, a value never closed", "not a sample line"),
    ("lines at the cap, escapes", 512.0),
    ("lines at the cap, empty labels", 512.0),
    ("most lines", 1024.0),
    ("one line too many", "more than 1024 lines")])
def test_any_page_matches_at_most_the_line_cap_at_most_the_line_limit_times(
        shape, read, monkeypatch):
    """Whatever a page holds, the label sets matched are at most MAX_SAMPLE_LINES of at most
    LINE_CAP bytes each (RE2: linear in them), and a bad line ends the read."""
    counting = CountingLabels(monkeypatch)
    name = "vllm:num_requests_running"
    if isinstance(read, str):
        with pytest.raises(ValueError, match=read):
            reader.parse_metrics(hostile_page(shape), {name})
    else:
        assert reader.parse_metrics(hostile_page(shape), {name}) == {name: read}
    assert counting.calls <= reader.MAX_SAMPLE_LINES
    assert counting.longest <= reader.LINE_CAP


def test_one_tenants_silent_pods_do_not_hold_another_tenants_read(monkeypatch):
    """Tenant a's pods accept connections and never answer (each read runs to its deadline);
    with a's reads taking its share of the scrape workers, tenant b's read in the same moment
    gets a worker and its values; a's reads past its share are not made this round (BUSY),
    never counted as timeouts of those pods."""
    server = vllmsim.page_server(REAL.encode(), "127.0.0.2")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(names, "PORT", server.server_address[1])
    hold = socket.socket()
    hold.bind(("127.0.0.7", server.server_address[1]))  # same port, another loopback address
    hold.listen(64)  # the kernel accepts; nobody ever answers
    scraper = reader.Scraper(workers=2)
    fine = [{"metadata": {"name": "fine", "uid": "f"}, "status": {"podIP": "127.0.0.2"}}]
    try:
        scraper.scrape(("b", "m"), fine, PROGRESS_METRICS)  # b reads every round too
        silent_pods = [{"metadata": {"name": f"s{i}", "uid": f"s{i}"},
                        "status": {"podIP": "127.0.0.7"}} for i in range(4)]
        out_a = {}
        reading = threading.Thread(target=lambda: out_a.update(
            scraper.scrape(("a", "hostile"), silent_pods, PROGRESS_METRICS)))
        reading.start()
        out_b = scraper.scrape(("b", "m"), fine, PROGRESS_METRICS)
        reading.join(10)
    finally:
        scraper.stop()
        server.shutdown()
        hold.close()
    assert out_b["fine"].values == {n: full_parse(REAL)[n] for n in PROGRESS_METRICS}
    kinds = sorted(r.error for r in out_a.values())
    assert kinds.count("timeout") == 1 and kinds.count(reader.BUSY) == 3, kinds
