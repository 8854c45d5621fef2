"""Decode steps replayed from CUDA graphs (services/engine/cuda_graphs.py; issue 20). On CPU the recordings are
EagerCapture's (each replay runs the recorded forward again), so the static buffers, the padding, the
choice of size and the frozen metadata (the fixed split count) are what runs, on the Triton backend
under the interpreter; the real torch.cuda.CUDAGraph capture runs only where CUDA is (make gpu-check)."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.arg_utils import engine_config_from_args
from splitserve.services.engine.config import CacheConfig, CudaGraphConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.cuda_graphs import EagerCapture, capture_sizes, graph_size
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.model_runner import ModelRunner
from splitserve.services.launcher.cli import build_parser
from splitserve.services.model.attention import triton_backend
from splitserve.services.model.attention.backend import AttentionMetadata

needs_triton = pytest.mark.skipif(not triton_backend.triton_installed(), reason="triton is not installed")
MAX_NUM_SEQS = 8  # captured sizes 1, 2, 4, 8


# -- sizes and configuration ---------------------------------------------------------------------------
def test_capture_sizes():
    assert capture_sizes(64, 256) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(512, 256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert capture_sizes(48, 256) == [1, 2, 4, 8, 16, 32, 48]  # the limit itself, so 33..48 have a graph
    assert capture_sizes(300, 100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(1, 256) == [1]
    assert capture_sizes(2, 256) == [1, 2]


def test_graph_size_is_the_smallest_that_holds_the_batch():
    sizes = [1, 2, 4, 8]
    assert [graph_size(sizes, n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


def test_config_defaults_off_and_validates():
    assert EngineConfig().cuda_graphs == CudaGraphConfig(enabled=False, max_batch_size=256)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        CudaGraphConfig(enabled=True, max_batch_size=0)


def test_cli_flags():
    parser = build_parser()
    default = engine_config_from_args(parser.parse_args(["generate", "hi"]))
    assert default.cuda_graphs == CudaGraphConfig()
    on = engine_config_from_args(parser.parse_args(["generate", "hi", "--cuda-graphs", "--cuda-graph-max-batch", "32"]))
    assert on.cuda_graphs == CudaGraphConfig(enabled=True, max_batch_size=32)
    worker = engine_config_from_args(parser.parse_args(["worker", "--cuda-graphs", "--no-cuda-graphs"]))
    assert worker.cuda_graphs.enabled is False


# -- graphed decode steps against eager ones (Triton backend, interpreted on CPU) ------------------------
class CountingCapture(EagerCapture):
    """EagerCapture that notes the size of every replay (rows of the recorded output)."""

    def __init__(self) -> None:
        self.replays: list[int] = []

    def capture(self, forward):
        def replay():
            out = forward()
            self.replays.append(out.shape[0])
            return out

        return replay


def _llm(folder, graphs: bool, backend: str = "triton", device: str = "auto") -> LLM:
    return LLM(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            device=device,
            attention_backend=backend,
            cache=CacheConfig(block_size=8, kv_cache_bytes=1024**2),
            scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64),
            cuda_graphs=CudaGraphConfig(enabled=graphs, max_batch_size=64),
        )
    )


def _record_logits(llm: LLM, monkeypatch) -> list[torch.Tensor]:
    """Every step's logits, as the engine gets them from its runner."""
    runner, logits = llm.engine.runner, []
    forward = runner.forward

    def spy(batch, layers=None):
        out = forward(batch, layers)
        logits.append(out.clone())
        return out

    monkeypatch.setattr(runner, "forward", spy)
    return logits


@pytest.mark.kernels  # the engine on the interpreted kernels: `make test`, not the unit run
@needs_triton
def test_graphed_decode_steps_match_eager_ones(tiny_llama_dir, monkeypatch):
    """3 and then 5 sequences decode (padded to 4 and 8): the same logits and greedy tokens as eager
    steps, and the same KV cache, so padding rows stored nothing. With an SM count as on a GPU, each
    graph's fixed split count (for max_model_len: 2) differs from the eager choice for these short
    contexts (1): trailing splits are empty."""
    from splitserve.kernels import paged_decode

    monkeypatch.setattr(paged_decode, "sm_count", lambda device: 132)
    rng = random.Random(5)
    groups = [[[rng.randrange(1, 300) for _ in range(n)] for n in lens] for lens in ([3, 11, 6], [2, 9, 17, 4, 7])]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    eager, graphed = _llm(tiny_llama_dir, graphs=False), _llm(tiny_llama_dir, graphs=True)
    assert eager.engine.runner.warm_up().num_graphs == 0
    capture = CountingCapture()
    assert graphed.engine.runner.warm_up(capture=capture).num_graphs == 4
    eager_logits, graphed_logits = _record_logits(eager, monkeypatch), _record_logits(graphed, monkeypatch)
    for prompts in groups:
        expected = [o.token_ids for o in eager.generate(prompts, params)]
        assert [o.token_ids for o in graphed.generate(prompts, params)] == expected
    # Per group: one prefill step (eager), then 3 decode steps of all its sequences (replayed).
    assert capture.replays == [4] * 3 + [8] * 3
    assert len(graphed_logits) == len(eager_logits) == 8
    for got, want in zip(graphed_logits, eager_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed.engine.runner.kv_cache, eager.engine.runner.kv_cache, rtol=1e-5, atol=1e-5)


@needs_triton
def test_graph_metadata_is_frozen_for_the_longest_context(tiny_llama_dir, monkeypatch):
    """What the backend reads on the host is the recording's: all rows decode, host lengths of
    max_model_len, the split count for it; a mixed step (a prompt next to decodes) runs eagerly."""
    from splitserve.kernels import paged_decode

    monkeypatch.setattr(paged_decode, "sm_count", lambda device: 132)
    llm = _llm(tiny_llama_dir, graphs=True)
    runner = llm.engine.runner
    metas: list[AttentionMetadata] = []
    forward = runner.backend.forward

    def spy(q, k, v, kv_cache, meta):
        metas.append(meta)
        return forward(q, k, v, kv_cache, meta)

    monkeypatch.setattr(runner.backend, "forward", spy)
    runner.warm_up(capture=EagerCapture())
    metas.clear()
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=2))
    prefill, decode = metas[0], metas[-1]  # the first layer's of the first step, the last layer's of the last
    assert prefill.decode_num_splits is None and prefill.num_decodes == 0
    assert decode.num_decodes == decode.num_seqs == 2
    assert decode.seq_lens_cpu == [runner.max_model_len] * 2 and decode.decode_num_splits == 2
    assert decode.slot_mapping.shape == (2,) and decode.block_tables.shape[1] == runner.max_model_len // 8


def test_graphs_off_with_a_reason(tiny_llama_dir, caplog):
    llm = _llm(tiny_llama_dir, graphs=True, backend="torch")
    with caplog.at_level(logging.WARNING, logger="splitserve.services.engine"):
        assert llm.engine.runner.warm_up(capture=EagerCapture()).num_graphs == 0
    assert "torch attention backend cannot replay decodes" in caplog.text
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))[0].token_ids
    runner = _llm(tiny_llama_dir, graphs=True, backend="torch", device="cpu").engine.runner
    with caplog.at_level(logging.WARNING, logger="splitserve.services.engine"):
        assert runner.warm_up().num_graphs == 0  # on CPU, no Capture given: nothing to gain
    assert "need a CUDA device, not cpu" in caplog.text
    tensor_parallel = SimpleNamespace(tp=SimpleNamespace(size=2), device=runner.device)
    assert "tensor parallel" in ModelRunner._no_graphs_reason(tensor_parallel, EagerCapture())  # type: ignore[arg-type]


def test_llm_warms_up_when_graphs_are_on(tiny_llama_dir):
    """LLM(...) with graphs on runs the warm-up that captures them (a worker runs it before serving);
    without it every step would run eagerly, silently. Off, it leaves the engine as built."""
    assert _llm(tiny_llama_dir, graphs=False, backend="torch", device="cpu").warm_up_report is None
    report = _llm(tiny_llama_dir, graphs=True, backend="torch", device="cpu").warm_up_report
    assert report is not None and report.num_steps >= 1 and report.num_graphs == 0  # CPU: nothing captured


# -- argument checks out of the per-step path ------------------------------------------------------------
@needs_triton
def test_the_triton_backend_checks_each_kernels_arguments_on_its_first_launch_only(monkeypatch):
    backend = triton_backend.TritonAttention(num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    checks: dict[str, list[bool]] = {}

    def recorder(name):
        def kernel(*args, check, **kwargs):
            checks.setdefault(name, []).append(check)

        return kernel

    kernels = SimpleNamespace(**{n: recorder(n) for n in ("store_kv", "paged_decode_attention", "rms_norm")})
    monkeypatch.setattr(backend, "kernels", kernels)
    monkeypatch.setattr(backend.ops, "kernels", kernels)
    q, kv = torch.zeros(2, 4, 16), torch.zeros(2, 2, 16)
    meta = AttentionMetadata(
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, 1, dtype=torch.int64),
        torch.ones(2, dtype=torch.int32),
        torch.arange(3, dtype=torch.int32),
        num_decodes=2,
        max_seq_len=1,
        seq_lens_cpu=[1, 1],
        query_lens_cpu=[1, 1],
    )
    for _ in range(3):
        backend.forward(q, kv, kv, torch.zeros(2, 4, 8, 2, 16), meta)
        backend.ops.rms_norm(q[:, 0], torch.ones(16), 1e-5)
        backend.ops.add_rms_norm(q[:, 0], q[:, 1], torch.ones(16), 1e-5)
    assert checks == {
        "store_kv": [True, False, False],
        "paged_decode_attention": [True, False, False],
        "rms_norm": [True, True] + [False] * 4,  # alone and with the residual add: a variant each
    }


# -- real CUDA graphs (skipped without CUDA; make gpu-check compares them at more sizes) ------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures torch.cuda.CUDAGraph: needs CUDA")
def test_cuda_graphs_on_the_gpu_match_eager(tiny_llama_dir):
    def llm(graphs: bool) -> LLM:
        config = EngineConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            device="cuda",
            attention_backend="triton",
            cache=CacheConfig(block_size=16, kv_cache_bytes=64 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256),
            cuda_graphs=CudaGraphConfig(enabled=graphs),
        )
        out = LLM(config)
        assert out.engine.warm_up().num_graphs == (4 if graphs else 0)
        return out

    rng = random.Random(8)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (3, 40, 17, 100, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    eager, graphed = llm(False).generate(prompts, params), llm(True).generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for got, want in zip(graphed, eager):
        for a, b in zip(got.logprobs, want.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-3
