"""Reading pods' /metrics: only the named samples are parsed, with the same values a full parse
gives, from a real vLLM 0.32.0 /metrics and from the stand-ins that serve it."""

import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vlm_operator import scrape
from vlm_operator.autoscaler import metric_names
from vlm_operator.stalls import PROGRESS_METRICS
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
    assert scrape.parse_metrics(REAL, names) == {n: everything[n] for n in names}
    assert scrape.parse_metrics(REAL, names)["vllm:request_success_total"] == 5.0  # 5 reasons


@pytest.mark.parametrize("name", ["vllm:request_success", "vllm:request_success_total_x",
                                  "vllm:e2e_request_latency_seconds", "process_open"])
def test_a_name_is_exact_not_a_prefix(name):
    assert scrape.parse_metrics(REAL, {name}) == {}


def test_every_sample_of_the_real_page_reads_as_in_a_full_parse():
    everything = full_parse(REAL)
    for name, value in everything.items():
        assert scrape.parse_metrics(REAL, {name}) == {name: value}, name


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
    old = scrape.builders.PORT
    scrape.builders.PORT = port
    scraper = scrape.Scraper(workers=4)
    try:
        pods = [{"metadata": {"name": "a", "uid": "1"}, "status": {"podIP": "127.0.0.2"}},
                {"metadata": {"name": "b", "uid": "2"}, "status": {}}]
        out = scraper.scrape(("team", "m"), pods, PROGRESS_METRICS)
    finally:
        scrape.builders.PORT = old
        scraper.stop()
        server.shutdown()
    assert out["a"].values == {n: full_parse(REAL)[n] for n in PROGRESS_METRICS}
    assert out["b"] == scrape.Scrape(error="no-ip")


def test_samples_with_and_without_labels_and_any_blank_are_summed():
    text = 'vllm:a\t3\nvllm:ab 4\nvllm:a{x="1"} 2\n# HELP vllm:a not a sample 9\n'
    assert scrape.parse_metrics(text, {"vllm:a"}) == {"vllm:a": 5.0}
