"""`make gpu-check`: the GPU path end to end on a CUDA host, in about 8 minutes on one H200 (the
tensor-parallel checks add about 2 on a host with 2 or more GPUs; the CUDA-graph check, not yet timed
on a GPU, perhaps 1 to 2).

Checks, in this order (each pass / fail / skip with its key numbers; one table at the end, and JSON
with --json):
  kernel-tests   tests/unit/kernels/test_kernels.py, test_kernels_engine.py, test_warm_up.py and test_cuda_graphs.py
                 compiled on the device (three pytest processes at once: compiling is CPU-bound)
  holdout-bf16   a tiny Llama made on the fly as tests/conftest.py does (no hub download), our engine in
                 bf16 on the Triton backend vs transformers on the same weights, teacher-forced on our
                 greedy tokens: log-probs within 2x transformers' own bf16 error, max and mean (both
                 against transformers fp32), and every token fp32's argmax or a near-tie within that bound
  warm-up        the same engine: ModelRunner.warm_up's steps and time, and Triton variants compiled
                 while serving after it (must be 0)
  holdout-fp32   the same prompts in fp32: greedy tokens equal transformers' generate(), token for token
  1p1d           `splitserve up --prefill 1 --decode 1 --devices cuda`: requests through the gateway, KV
                 moved between the tiers; each worker's step loop and KV handoffs in its engine core
                 process, which owns the device (the serving processes must stay off it)
  2-per-gpu      `splitserve up --workers 2 --devices cuda:0,cuda:0 --gpu-memory-fraction 0.4`
  cuda-graphs    the tiny Llama with decode steps replayed from CUDA graphs (--cuda-graphs) against eager
                 steps: fp32 greedy tokens and log-probs (sampled token and top 5) on 13 prompts (decode
                 batches padded 13 -> 16), and the bf16 decode-step time, eager and replayed, at batch
                 sizes 1, 4, 16 and 64 (context 512; host packing and logits included, no sampling)
  bench-kernels  benchmarks/attention_kernels.py on a reduced grid (--bench-full: all of it), with its end-to-end
                 decode-step table (SmolLM2, both backends)
  tp-logits      (2+ GPUs) the tiny Llama in bf16 with 2 tensor-parallel ranks (cuda:0, cuda:1) against 1
                 rank: teacher-forced log-probs of the 2-rank engine as in holdout-bf16, and the two
                 engines' log-probs (sampled token and top 5) wherever their contexts agree within the
                 same bound (2x transformers' own bf16 error); a differing greedy token must be a
                 near-tie within it. (The bundled SmolLM2's 9 query / 3 KV heads split over 1 or 3
                 ranks only; the tiny Llama's 4 / 2 split over 2.)
  tp-1p1d        (2+ GPUs) `splitserve up --prefill 1 --decode 1 --prefill-tp 2 --decode-tp 1 --devices
                 cuda`: requests through the gateway, KV moved from a 2-rank prefill worker to a 1-rank
                 decode worker
The tp-* checks are skipped, with the reason printed, on a host with fewer than 2 GPUs. A check that
would start past --budget-s is skipped. Without CUDA this exits 2 with a message.

Usage: python scripts/gpu_check.py [--json PATH] [--only NAME,...] [--skip NAME,...] [--budget-s 600]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHECKS = (
    "kernel-tests",
    "holdout-bf16",
    "warm-up",
    "holdout-fp32",
    "1p1d",
    "2-per-gpu",
    "cuda-graphs",
    "bench-kernels",
    "tp-logits",
    "tp-1p1d",
)
HOLDOUT_LENS = [1, 3, 9, 17, 40, 75, 600, 1300]  # the long prompts decode with 2 and 4 splits
MAX_NEW = 24
MAX_MODEL_LEN = 2048
DEVICE, BACKEND = "cuda", "triton"  # what the holdout runs on (a CPU dry run of this script changes them)
TP_SIZE = 2  # ranks of the tensor-parallel checks, each on its own GPU
GRAPH_PROMPT_LENS = [1, 3, 9, 17, 40, 75, 120, 5, 33, 64, 250, 2, 600]  # 13 sequences decode at once
GRAPH_BATCHES = (1, 4, 16, 64)  # decode-step timings, eager and replayed
GRAPH_CONTEXT = 512
GRAPH_LOGPROB_BOUND = 1e-3  # fp32: eager and replayed differ in summation order only


@dataclass
class Result:
    name: str
    status: str  # pass | fail | skip
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)
    detail: str = ""


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, never interpreted
    return dict(env, PYTHONUNBUFFERED="1")


def make_tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama (head_dim 64, GQA 2, 2048 positions) and the test BPE tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import VOCAB_SIZE, _train_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    _train_tokenizer(folder)
    return folder


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 320) for _ in range(n)] for n in lengths]


# -- kernel tests --------------------------------------------------------------------------------------
def kernel_tests(timeout_s: float) -> Result:
    attention = "paged_decode_attention or paged_prefill_attention"
    groups = [
        ["tests/unit/kernels/test_kernels.py", "-k", "paged_decode_attention"],
        ["tests/unit/kernels/test_kernels.py", "-k", "paged_prefill_attention"],
        [
            "tests/unit/kernels/test_kernels.py",
            "tests/unit/model/test_kernels_engine.py",
            "tests/unit/engine/test_warm_up.py",
            "tests/unit/engine/test_cuda_graphs.py",
        ]
        + ["-k", f"not ({attention})"],
    ]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    procs = [
        subprocess.Popen(
            cmd + g, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for g in groups
    ]
    counts: dict[str, int] = {}
    tails, codes = [], []
    with ThreadPoolExecutor(len(procs)) as pool:
        outputs = list(pool.map(lambda p: _communicate(p, timeout_s), procs))
    for proc, out in zip(procs, outputs):
        codes.append(proc.returncode)
        last = out.strip().splitlines()[-1] if out.strip() else ""
        for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last):
            counts[word] = counts.get(word, 0) + int(number)
        if proc.returncode != 0:
            tails.append(out[-3000:])
    ok = all(c == 0 for c in codes) and counts.get("passed", 0) > 0
    return Result("kernel-tests", "pass" if ok else "fail", numbers=counts, detail="\n".join(tails))


def _communicate(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0] + f"\n[killed after {timeout_s:.0f} s]"


# -- holdout vs transformers (runs in a child: --holdout DIR OUT) -------------------------------------------
def compiled_variants() -> int | None:
    """Compiled Triton kernels held by splitserve.kernels' JIT functions (None if this Triton keeps
    them elsewhere)."""
    import splitserve.kernels as K

    total = 0
    for module in (K.paged_decode, K.paged_prefill, K.store_kv, K.rms_norm, K.rotary_embedding, K.silu_and_mul):
        for obj in vars(module).values():
            caches = getattr(obj, "device_caches", None)
            if caches is None:
                continue
            try:
                total += sum(len(entry[0]) for entry in caches.values())
            except (TypeError, IndexError):
                return None
    return total


def holdout_engine(model_dir: str, dtype: str, tensor_parallel_size: int = 1, **overrides):
    """The checks' engine on the device under test; overrides replace EngineConfig fields."""
    from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.services.engine.llm import LLM

    fields = {
        "model": model_dir,
        "dtype": dtype,
        "device": DEVICE,
        "attention_backend": BACKEND,
        "max_model_len": MAX_MODEL_LEN,
        "tensor_parallel_size": tensor_parallel_size,
        "cache": CacheConfig(block_size=16, kv_cache_bytes=512 * 1024**2),
        "scheduler": SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
    }
    return LLM(EngineConfig(**(fields | overrides)))


def run_holdout(model_dir: str, out_path: str) -> None:
    import torch

    from splitserve.common.sampling_params import SamplingParams

    def engine(dtype: str):
        return holdout_engine(model_dir, dtype)

    ids = prompts(HOLDOUT_LENS)
    llm = engine("bfloat16")
    before_warm_up = compiled_variants()
    report = llm.engine.warm_up()
    after_warm_up = compiled_variants()
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5))
    after_serving = compiled_variants()
    warm = {
        "steps": report.num_steps,
        "seconds": round(report.seconds, 2),
        "compiled_by_warm_up": None if after_warm_up is None else after_warm_up - (before_warm_up or 0),
        "compiled_while_serving": None if after_serving is None else after_serving - (after_warm_up or 0),
    }
    del llm
    torch.cuda.empty_cache()
    bf16 = compare_logprobs(model_dir, ids, outs)
    llm = engine("float32")
    ours32 = [o.token_ids for o in llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))]
    del llm
    fp32 = compare_greedy(model_dir, ids, ours32)
    Path(out_path).write_text(json.dumps({"warm_up": warm, "bf16": bf16, "fp32": fp32}))


def compare_logprobs(model_dir: str, ids: list[list[int]], outs) -> dict:
    """Teacher-forced on our bf16 greedy tokens: our log-probs (sampled token and top 5) and transformers'
    bf16 ones, each against transformers fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = {
        dt: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(DEVICE).eval()
        for dt in ("float32", "bfloat16")
    }
    ours_err = hf16_err = worst_margin = ours_sum = hf16_sum = 0.0
    num_tokens = num_argmax = num_compared = 0
    with torch.no_grad():
        for prompt, out in zip(ids, outs):
            full = torch.tensor([prompt + out.token_ids], device=DEVICE)
            rows = slice(len(prompt) - 1, len(prompt) - 1 + len(out.token_ids))
            lp = {dt: torch.log_softmax(m(full).logits[0, rows].float(), -1) for dt, m in hf.items()}
            for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
                ref = lp["float32"][t]
                for tok, value in [(token, entry.logprob), *entry.top]:
                    ours, hf16 = abs(value - ref[tok].item()), abs(lp["bfloat16"][t, tok].item() - ref[tok].item())
                    ours_err, hf16_err = max(ours_err, ours), max(hf16_err, hf16)
                    ours_sum, hf16_sum, num_compared = ours_sum + ours, hf16_sum + hf16, num_compared + 1
                margin = (ref.max() - ref[token]).item()
                worst_margin = max(worst_margin, margin)
                num_argmax += int(margin == 0.0)
                num_tokens += 1
    bound = 2 * hf16_err + 0.05
    mean, hf16_mean = ours_sum / max(1, num_compared), hf16_sum / max(1, num_compared)
    ok = ours_err <= bound and worst_margin <= bound and mean <= 2 * hf16_mean + 0.01
    return {
        "ok": ok,
        "tokens": num_tokens,
        "fp32_argmax": num_argmax,
        "max_err": round(ours_err, 4),
        "hf_bf16_max_err": round(hf16_err, 4),
        "mean_err": round(mean, 4),
        "hf_bf16_mean_err": round(hf16_mean, 4),
        "worst_margin": round(worst_margin, 4),
    }


def compare_greedy(model_dir: str, ids: list[list[int]], ours: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    equal, first_diff = 0, None
    with torch.no_grad():
        for i, prompt in enumerate(ids):
            x = torch.tensor([prompt], device=DEVICE)
            gen = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False
            )
            theirs = gen[0, len(prompt) :].tolist()
            equal += int(theirs == ours[i])
            if theirs != ours[i] and first_diff is None:
                pos = next(j for j, (a, b) in enumerate(zip(theirs, ours[i])) if a != b)
                first_diff = f"prompt {i} (len {len(prompt)}) token {pos}"
    return {"ok": equal == len(ids), "prompts_equal": f"{equal}/{len(ids)}", "first_diff": first_diff}


def run_child(flag: str, model_dir: Path, out: Path, timeout_s: float) -> str:
    """This script run again with flag (a check in a fresh process, writing out); returns its log."""
    cmd = [sys.executable, __file__, flag, str(model_dir), str(out)]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
        return done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        return f"timed out after {timeout_s:.0f} s\n{e.stdout or ''}{e.stderr or ''}"


def child_result(name: str, flag: str, model_dir: Path, timeout_s: float, verdict: Callable[[dict], Result]) -> Result:
    """One check run in a child (run_child) and judged by verdict on the JSON it wrote; fail with its log if none."""
    out = model_dir.parent / f"{flag.lstrip('-')}.json"
    log = run_child(flag, model_dir, out, timeout_s)
    if not out.exists():
        return Result(name, "fail", detail=str(log)[-3000:])
    return verdict(json.loads(out.read_text()))


def holdout(model_dir: Path, timeout_s: float) -> list[Result]:
    out = model_dir.parent / "holdout.json"
    log = run_child("--holdout", model_dir, out, timeout_s)
    if not out.exists():
        return [Result(name, "fail", detail=str(log)[-3000:]) for name in ("holdout-bf16", "warm-up", "holdout-fp32")]
    data = json.loads(out.read_text())
    warm = data["warm_up"]
    warm_ok = warm["compiled_while_serving"] == 0
    warm_status = "skip" if warm["compiled_while_serving"] is None else ("pass" if warm_ok else "fail")
    return [
        Result("holdout-bf16", "pass" if data["bf16"].pop("ok") else "fail", numbers=data["bf16"]),
        Result("warm-up", warm_status, numbers=warm),
        Result("holdout-fp32", "pass" if data["fp32"].pop("ok") else "fail", numbers=data["fp32"]),
    ]


# -- clusters ------------------------------------------------------------------------------------------
def run_cluster(name: str, up_args: list[str], model_dir: Path, timeout_s: float) -> Result:
    """Start `splitserve up` with up_args, send 8 greedy requests at once, read the workers' metrics, stop."""
    from splitserve.common.serving import free_port

    port, admin = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "splitserve.services.launcher.cli",
        "up",
        *up_args,
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        "--model",
        str(model_dir),
    ]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN)]
    lines: list[str] = []
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
    start = time.monotonic()
    try:
        while not any("splitserve is up" in line for line in lines):
            if proc.poll() is not None or time.monotonic() - start > timeout_s / 2:
                return Result(name, "fail", detail="did not come up:\n" + "".join(lines[-60:]))
            time.sleep(0.2)
        numbers: dict = {"startup_s": round(time.monotonic() - start, 1)}
        numbers.update(send_requests(f"127.0.0.1:{port}"))
        numbers.update(worker_metrics(lines))
        numbers["warm_up_s"] = [
            float(s) for s in re.findall(r"warm-up before serving: \d+ steps in ([\d.]+) s", "".join(lines))
        ]
        return Result(name, "pass", numbers=numbers)
    finally:
        stop_process(proc)


def send_requests(address: str, num: int = 8, max_tokens: int = 32) -> dict:
    import grpc

    from splitserve.protos.v1 import generation_pb2 as pb
    from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc

    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))

    def one(ids: list[int]) -> tuple[int, float]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParameters(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=max_tokens),
        )
        sent, first, count = time.monotonic(), None, 0
        for chunk in stub.Generate(request, timeout=60):
            first = first or time.monotonic()
            count += len(chunk.token_ids)
        return count, 1e3 * ((first or sent) - sent)

    with ThreadPoolExecutor(num) as pool:
        done = list(pool.map(one, prompts([5 + 150 * i for i in range(num)], seed=9)))
    ttfts = sorted(t for _, t in done)
    return {"requests_ok": f"{sum(n == max_tokens for n, _ in done)}/{num}", "ttft_ms_p50": round(ttfts[num // 2], 1)}


def worker_metrics(lines: list[str]) -> dict:
    """Per worker: KV blocks it chose, requests finished, KV blocks sent (prefill tier)."""
    found: dict = {}
    for worker, address in re.findall(r"^\s+(\S+): grpc \S+ metrics (http://\S+/metrics)", "".join(lines), re.M):
        text = urllib.request.urlopen(address, timeout=5).read().decode()
        found[worker] = {
            key: int(sum(float(v) for v in re.findall(rf"^splitserve_{metric}\S* (\S+)$", text, re.M)))
            for key, metric in (
                ("kv_blocks", "num_kv_blocks"),
                ("finished", "request_success_total"),
                ("sent_blocks", r"kv_transfer_blocks_total\{[^}]*direction=\"sent\""),
            )
        }
    return {"workers": found}


def stop_process(proc: subprocess.Popen) -> None:
    """SIGINT (`splitserve up` stops its children), then the whole group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cluster_1p1d(model_dir: Path, timeout_s: float) -> Result:
    # One GPU: both workers share it, so each takes 0.4 of it; with more, they land on different GPUs.
    args = ["--prefill", "1", "--decode", "1", "--devices", "cuda", "--gpu-memory-fraction", "0.4"]
    result = run_cluster("1p1d", args, model_dir, timeout_s)
    workers = result.numbers.get("workers", {})
    sent = sum(w["sent_blocks"] for w in workers.values())
    if result.status == "pass" and (result.numbers["requests_ok"] != "8/8" or sent == 0):
        result.status = "fail"
    return result


def cluster_two_per_gpu(model_dir: Path, timeout_s: float) -> Result:
    args = ["--workers", "2", "--devices", "cuda:0,cuda:0", "--gpu-memory-fraction", "0.4"]
    result = run_cluster("2-per-gpu", args, model_dir, timeout_s)
    workers = result.numbers.get("workers", {})
    blocks_ok = len(workers) == 2 and all(w["kv_blocks"] > 0 for w in workers.values())
    if result.status == "pass" and (result.numbers["requests_ok"] != "8/8" or not blocks_ok):
        result.status = "fail"
    return result


# -- CUDA graphs (in a child: --graphs DIR OUT) ---------------------------------------------------------
def graphs_engine(model_dir: str, dtype: str, graphs: bool):
    from splitserve.services.engine.config import CudaGraphConfig, SchedulerConfig

    scheduler = SchedulerConfig(max_num_seqs=max(GRAPH_BATCHES), max_num_batched_tokens=2048)
    return holdout_engine(model_dir, dtype, scheduler=scheduler, cuda_graphs=CudaGraphConfig(enabled=graphs))


def decode_step_ms(runner, batch: int, iters: int = 50) -> float:
    """Mean time of a step of batch decodes at GRAPH_CONTEXT tokens each (ModelRunner.shape_forward:
    host packing, the forward, replayed when a graph fits, and the logits)."""
    import torch

    from splitserve.services.engine.model_runner import StepShape

    run = runner.shape_forward(StepShape((GRAPH_CONTEXT,) * batch, (1,) * batch))
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / iters


def run_graphs(model_dir: str, out_path: str) -> None:
    import torch

    from splitserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    outs, step_ms, warm = {}, {}, {}
    for graphs in (False, True):
        llm = graphs_engine(model_dir, "float32", graphs)  # LLM warms up (and captures) itself with graphs on
        if llm.warm_up_report is None:
            llm.engine.warm_up()  # the eager side compiles the same kernel variants first
        outs[graphs] = llm.generate(prompts(GRAPH_PROMPT_LENS, seed=3), params)
        del llm
        llm = graphs_engine(model_dir, "bfloat16", graphs)
        report = llm.warm_up_report or llm.engine.warm_up()
        warm[graphs] = {"num_graphs": report.num_graphs, "seconds": round(report.seconds, 2)}
        step_ms[graphs] = {b: round(decode_step_ms(llm.engine.runner, b), 3) for b in GRAPH_BATCHES}
        del llm
        torch.cuda.empty_cache()
    vs_eager = compare_ranks(outs[False], outs[True])  # eager as the "one rank" side: same comparison
    Path(out_path).write_text(json.dumps({"vs_eager": vs_eager, "step_ms": step_ms, "warm_up": warm}))


def graphs_verdict(data: dict) -> Result:
    """Pass: graphs captured, log-probs within GRAPH_LOGPROB_BOUND of eager, any differing token a near-tie."""
    vs, warm = data["vs_eager"], data["warm_up"]
    tie = vs["worst_tie"]
    ok = warm["true"]["num_graphs"] > 0 and vs["max_diff"] <= GRAPH_LOGPROB_BOUND
    ok = ok and isinstance(tie, float | int) and tie <= GRAPH_LOGPROB_BOUND
    numbers = {"graphs": warm["true"]["num_graphs"], **{f"fp32_{k}": v for k, v in vs.items()}}
    numbers["warm_up_s"] = f"{warm['false']['seconds']} eager, {warm['true']['seconds']} with capture"
    for batch, eager_ms in data["step_ms"]["false"].items():
        numbers[f"step_ms_b{batch}"] = f"{eager_ms} eager, {data['step_ms']['true'][batch]} graphs"
    return Result("cuda-graphs", "pass" if ok else "fail", numbers=numbers)


def cuda_graphs(model_dir: Path, timeout_s: float) -> Result:
    return child_result("cuda-graphs", "--graphs", model_dir, timeout_s, graphs_verdict)


# -- tensor parallelism (2+ GPUs; the comparison runs in a child: --tp-holdout DIR OUT) -----------------
def tp_skip_reason(num_gpus: int) -> str | None:
    """Why the tp-* checks cannot run here (None: they can)."""
    if num_gpus < TP_SIZE:
        return f"{num_gpus} GPU(s) visible: {TP_SIZE} tensor-parallel ranks need a GPU each"
    return None


def run_tp_holdout(model_dir: str, out_path: str) -> None:
    """Greedy bf16 with log-probs at 1 rank and at TP_SIZE ranks (rank r on cuda:r), then both comparisons."""
    from splitserve.common.sampling_params import SamplingParams

    ids = prompts(HOLDOUT_LENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    outs = {}
    for size in (1, TP_SIZE):
        llm = holdout_engine(model_dir, "bfloat16", size)
        try:
            outs[size] = llm.generate(ids, params)
        finally:
            llm.engine.close()  # stops the follower ranks
        del llm
    vs_hf = compare_logprobs(model_dir, ids, outs[TP_SIZE])
    Path(out_path).write_text(json.dumps({"vs_hf": vs_hf, "vs_one_rank": compare_ranks(outs[1], outs[TP_SIZE])}))


def compare_ranks(ones, manys) -> dict:
    """Log-probs (sampled token and top 5) of a 1-rank and a many-rank engine wherever both saw the same
    context: each prompt up to and including its first differing token. worst_tie: at a differing
    token, how much more the 1-rank engine liked its own pick than the other's (inf: not in its top 5)."""
    max_diff = sum_diff = worst_tie = 0.0
    num_compared = num_equal = 0
    for one, many in zip(ones, manys):
        num_equal += int(one.token_ids == many.token_ids)
        for t, (a, b) in enumerate(zip(one.logprobs, many.logprobs)):
            la = dict([(one.token_ids[t], a.logprob), *a.top])
            lb = dict([(many.token_ids[t], b.logprob), *b.top])
            for token in la.keys() & lb.keys():
                diff = abs(la[token] - lb[token])
                max_diff, sum_diff, num_compared = max(max_diff, diff), sum_diff + diff, num_compared + 1
            if one.token_ids[t] != many.token_ids[t]:
                worst_tie = max(worst_tie, la[one.token_ids[t]] - la.get(many.token_ids[t], float("-inf")))
                break
    return {
        "prompts_equal": f"{num_equal}/{len(ones)}",
        "max_diff": round(max_diff, 4),
        "mean_diff": round(sum_diff / max(1, num_compared), 4),
        "worst_tie": round(worst_tie, 4) if worst_tie != float("inf") else "not in top 5",
    }


def tp_logits_verdict(data: dict) -> Result:
    """Pass: the many-rank engine within holdout-bf16's bound of transformers fp32, and within the same
    bound of the 1-rank engine (log-probs, and any differing greedy token a near-tie)."""
    vs_hf, vs_one = data["vs_hf"], data["vs_one_rank"]
    bound = 2 * vs_hf["hf_bf16_max_err"] + 0.05
    tie = vs_one["worst_tie"]
    ok = vs_hf.pop("ok") and vs_one["max_diff"] <= bound and isinstance(tie, float | int) and tie <= bound
    numbers = {"bound": round(bound, 4), **{f"1rank_{k}": v for k, v in vs_one.items()}}
    numbers |= {"vs_hf_max_err": vs_hf["max_err"], "vs_hf_mean_err": vs_hf["mean_err"]}
    numbers["hf_bf16_max_err"] = vs_hf["hf_bf16_max_err"]
    return Result("tp-logits", "pass" if ok else "fail", numbers=numbers)


def tp_logits(model_dir: Path, timeout_s: float) -> Result:
    return child_result("tp-logits", "--tp-holdout", model_dir, timeout_s, tp_logits_verdict)


def cluster_tp_1p1d(model_dir: Path, timeout_s: float) -> Result:
    # Prefill ranks on cuda:0 and cuda:1; the decode worker on cuda:2, or beside rank 0 on a 2-GPU host.
    args = ["--prefill", "1", "--decode", "1", "--prefill-tp", str(TP_SIZE), "--decode-tp", "1"]
    args += ["--devices", "cuda", "--gpu-memory-fraction", "0.4"]
    result = run_cluster("tp-1p1d", args, model_dir, timeout_s)
    workers = result.numbers.get("workers", {})
    sent = sum(w["sent_blocks"] for w in workers.values())
    if result.status == "pass" and (result.numbers["requests_ok"] != "8/8" or sent == 0):
        result.status = "fail"
    return result


def when_gpus(name: str, check):
    """A step that runs check, or skips it with the reason on a host with too few GPUs."""

    def run(timeout_s: float) -> list[Result]:
        import torch

        reason = tp_skip_reason(torch.cuda.device_count())
        if reason is not None:
            print(f"gpu_check: {name} skipped: {reason}", flush=True)
            return [Result(name, "skip", numbers={"reason": reason})]
        return [check(timeout_s)]

    return run


# -- benchmarks ----------------------------------------------------------------------------------------
def bench_kernels(out_dir: Path, full: bool, timeout_s: float) -> Result:
    out = out_dir / "bench_kernels.json"
    grid = [] if full else ["--batches", "1,64,256", "--contexts", "4096,32768"]
    cmd = [sys.executable, "benchmarks/attention_kernels.py", "--json", str(out), *grid]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
        log = done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        log = f"timed out after {timeout_s:.0f} s"
    if not out.exists():
        return Result("bench-kernels", "fail", detail=log[-3000:])
    data = json.loads(out.read_text())
    numbers: dict = {"json": str(out)}
    for r in data["decode"]:
        if r.get("batch") == 64 and r.get("context") == 4096 and "gbps" in r:
            numbers["decode_b64_4k"] = f"{r['gbps']:.0f} GB/s, {r['peak_pct'] or 0:.0f}% peak, {r['num_splits']} splits"
    full_rows = [r for r in data["prefill"] if r["mode"] == "full" and "tflops" in r]
    if full_rows:
        numbers["prefill_best_tflops"] = round(max(r["tflops"] for r in full_rows), 1)
    for r in data["e2e"]:
        if r["batch"] in (1, 64):
            numbers[f"step_ms_{r['backend']}_b{r['batch']}"] = round(r["step_ms"], 2)
    return Result("bench-kernels", "pass", numbers=numbers, detail=log[-2000:] if not numbers else "")


# -- driver --------------------------------------------------------------------------------------------
def print_table(results: list[Result]) -> None:
    print(f"\n{'check':<14}{'status':<8}{'time s':>7}  numbers")
    for r in results:
        numbers = ", ".join(f"{k}={v}" for k, v in r.numbers.items() if k != "workers")
        if "workers" in r.numbers:
            numbers += ", " + "; ".join(f"{w}: {v}" for w, v in r.numbers["workers"].items())
        print(f"{r.name:<14}{r.status:<8}{r.seconds:>7.1f}  {numbers}")
    for r in results:
        if r.status == "fail" and r.detail:
            print(f"\n--- {r.name} ---\n{r.detail}")


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is False); it runs on a GPU host only. "
            "On this machine the CPU tests are `make test` (kernels under the Triton interpreter).",
            file=sys.stderr,
        )
        sys.exit(2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--skip", default="", help="comma-separated checks to skip")
    parser.add_argument("--budget-s", type=float, default=600.0, help="start no check after this many seconds")
    parser.add_argument("--bench-full", action="store_true", help="the kernel benchmark's whole grid")
    parser.add_argument("--holdout", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--tp-holdout", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--graphs", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.holdout:
        run_holdout(*args.holdout)
        return 0
    if args.tp_holdout:
        run_tp_holdout(*args.tp_holdout)
        return 0
    if args.graphs:
        run_graphs(*args.graphs)
        return 0
    if "TRITON_INTERPRET" in os.environ:
        print("gpu_check: ignoring TRITON_INTERPRET for the checks (they compile the kernels)", file=sys.stderr)
    require_cuda()
    import torch
    import triton

    wanted = [c for c in CHECKS if (not args.only or c in args.only.split(",")) and c not in args.skip.split(",")]
    deadline = time.monotonic() + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    model_dir = make_tiny_model(work / "tiny-llama")
    results: list[Result] = []
    steps = [
        ("kernel-tests", 60, 240, lambda t: [kernel_tests(t)]),
        ("holdout-bf16", 30, 150, lambda t: holdout(model_dir, t)),
        ("1p1d", 40, 150, lambda t: [cluster_1p1d(model_dir, t)]),
        ("2-per-gpu", 40, 150, lambda t: [cluster_two_per_gpu(model_dir, t)]),
        ("cuda-graphs", 40, 240, lambda t: [cuda_graphs(model_dir, t)]),
        ("bench-kernels", 60, 240, lambda t: [bench_kernels(work, args.bench_full, t)]),
        ("tp-logits", 40, 180, when_gpus("tp-logits", lambda t: tp_logits(model_dir, t))),
        ("tp-1p1d", 40, 150, when_gpus("tp-1p1d", lambda t: cluster_tp_1p1d(model_dir, t))),
    ]
    holdout_names = {"holdout-bf16", "warm-up", "holdout-fp32"}
    for name, min_s, max_s, run in steps:
        names = holdout_names if name == "holdout-bf16" else {name}
        if not names & set(wanted):
            continue
        left = deadline - time.monotonic()
        if left < min_s:
            results += [Result(n, "skip", numbers={"reason": f"time budget, {left:.0f} s left"}) for n in sorted(names)]
            continue
        print(f"gpu_check: {name} ...", flush=True)
        start = time.monotonic()
        try:
            got = run(min(max_s, left))
        except Exception as e:  # one broken check must not hide the others' results
            got = [Result(n, "fail", detail=f"{type(e).__name__}: {e}") for n in sorted(names)]
        for r in got:
            r.seconds = time.monotonic() - start
        results += [r for r in got if r.name in wanted]
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "device": torch.cuda.get_device_name(0),
            "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "checks": [asdict(r) for r in results],
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"\nwrote {args.json}")
    return 0 if all(r.status != "fail" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
