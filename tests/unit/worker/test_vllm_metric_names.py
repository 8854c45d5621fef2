"""--vllm-metric-names: a worker's vLLM-named series (what inference-perf, llm-d's scorers and KEDA
rules written for vLLM read) beside its splitserve_ ones, with the same values."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.services.worker.metrics import VLLM_NAMES, EngineSnapshot, RequestTiming, WorkerMetrics


def _samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _worker(vllm_names: bool) -> WorkerMetrics:
    metrics = WorkerMetrics("m", "decode", lambda: EngineSnapshot(3, 2, 0.25, 1, 10, 5), vllm_names=vllm_names)
    metrics.observe_finished(RequestTiming(arrival=0.0, first_token=0.5, finished=2.0), 7, 4, "length")
    return metrics


def test_vllm_names_mirror_the_splitserve_series():
    samples = _samples(_worker(vllm_names=True))
    vllm = {k: v for k, v in samples.items() if k[0].startswith("vllm:")}
    assert {name.removeprefix("vllm:") for name, _ in vllm} >= {"num_requests_running", "kv_cache_usage_perc"}
    exported = {name.removeprefix("vllm:").removesuffix("_total") for name, _ in vllm}
    assert {n for n in VLLM_NAMES if not n.endswith("_seconds")} <= exported
    for (name, labels), value in vllm.items():
        assert samples[("splitserve_" + name.removeprefix("vllm:"), labels)] == value
    labels = (("model_name", "m"), ("role", "decode"))
    assert vllm[("vllm:num_requests_running", labels)] == 3
    assert vllm[("vllm:prompt_tokens_total", labels)] == 7
    assert vllm[("vllm:time_to_first_token_seconds_count", labels)] == 1


def test_vllm_names_are_off_by_default():
    assert not [name for name, _ in _samples(_worker(vllm_names=False)) if name.startswith("vllm:")]
