"""deploy/: the KubeRay manifests validate against KubeRay's own CRD schemas, and every file, script,
config and import path the manifests, the Dockerfile and the compose file name exists and works."""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
import os
import posixpath
import re
import shlex
from importlib import metadata
from pathlib import Path

import jsonschema
import pydantic
import pytest
import ray
import torch
import yaml
from packaging.requirements import Requirement

from cs3ray.config import load_config
from cs3ray.errors import UserError
from cs3ray.ops.cluster_env import CLUSTER_ENV, HAPROXY_ENV, SERVING_CLUSTER_ENV

from conftest import ROOT
from helpers.serve_checkpoints import make_checkpoint

DEPLOY = ROOT / "deploy"
KUBERAY = "v1.7.0"  # the release the schemas come from (tests/data/kuberay/v1.7.0/README.md)
SCHEMAS = ROOT / "tests" / "data" / "kuberay" / KUBERAY
KINDS = {"RayCluster": "raycluster", "RayJob": "rayjob", "RayService": "rayservice"}
SECRET_WORDS = re.compile(r"TOKEN|SECRET|PASSWORD|CREDENTIAL|ACCESS_KEY|API_KEY", re.I)
# pyproject.toml as installed (tomllib is Python >= 3.11 only).
DIST = metadata.distribution("cs3ray")


def manifests() -> dict[str, tuple[Path, dict]]:
    """Every KubeRay object under deploy/, by kind: (file, object)."""
    found: dict[str, tuple[Path, dict]] = {}
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith("ray.io/"):
                assert doc["kind"] not in found, f"two {doc['kind']} manifests: {found[doc['kind']][0]}, {path}"
                found[doc["kind"]] = (path, doc)
    return found


MANIFESTS = manifests()


def strict(schema: dict) -> dict:
    """`schema` rejecting unknown fields, as `kubectl apply`'s strict field validation does (a CRD's
    structural schema only prunes them, which would let a misspelt field pass unseen)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def validator(kind: str) -> jsonschema.Draft4Validator:
    """A validator for `kind`'s vendored CRD schema (OpenAPI v3.0 schemas are JSON Schema draft 4 style)."""
    schema = json.loads((SCHEMAS / f"{KINDS[kind]}.schema.json").read_text())
    return jsonschema.Draft4Validator(strict(schema))


def errors(kind: str, obj: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(kind).iter_errors(obj)]


def cluster_spec(kind: str, obj: dict | None = None) -> dict:
    """The RayCluster spec of a manifest of `kind` (by default the one in deploy/)."""
    spec = (obj or MANIFESTS[kind][1])["spec"]
    return {"RayCluster": spec, "RayJob": spec.get("rayClusterSpec"), "RayService": spec.get("rayClusterConfig")}[kind]


def ray_containers(kind: str) -> list[dict]:
    """The Ray container (the first) of the head and of every worker group."""
    spec = cluster_spec(kind)
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [group["template"]["spec"]["containers"][0] for group in groups]


def env_of(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def test_deploy_has_one_manifest_of_each_kind_each_a_kind_line():
    assert set(MANIFESTS) == set(KINDS)
    for path, obj in MANIFESTS.values():
        assert re.search(rf"^kind: {obj['kind']}$", path.read_text(), re.M), path
    # KubeRay names each one's head Service NAME-head-svc: distinct names let all three run in one namespace.
    assert len({obj["metadata"]["name"] for _, obj in MANIFESTS.values()}) == len(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_manifest_validates_against_kuberays_crd_schema(kind):
    path, obj = MANIFESTS[kind]
    assert obj["apiVersion"] == "ray.io/v1"
    assert errors(kind, obj) == [], path
    # KubeRay's webhook-free checks on names: a DNS-1035 label (RayService: at most 48 characters).
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,46}[a-z0-9])?", obj["metadata"]["name"])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_broken_manifest_fails_validation(kind):
    """The validation is real: a wrong type, a value outside an enum and a misspelt field each fail."""
    obj = MANIFESTS[kind][1]

    def broken(change) -> list[str]:
        bad = copy.deepcopy(obj)
        change(cluster_spec(kind, bad))
        return errors(kind, bad)

    assert any("'two' is not of type 'integer'" in e for e in broken(
        lambda s: s["workerGroupSpecs"][0].update(replicas="two")))
    assert any("is not one of" in e for e in broken(lambda s: s["authOptions"].update(mode="tokens")))
    assert any("'authOption'" in e for e in broken(lambda s: s.update(authOption=s.pop("authOptions"))))
    assert any("containers" in e for e in broken(
        lambda s: s["headGroupSpec"]["template"]["spec"]["containers"][0].update(resources={"limits": ["cpu"]})))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ray_token_auth_from_a_secret(kind):
    auth = cluster_spec(kind)["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"]
    assert cluster_spec(kind)["rayVersion"] == ray.__version__  # KubeRay needs >= 2.52 for tokens


def test_secrets_are_referenced_never_inlined():
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert not (isinstance(doc, dict) and doc.get("kind") == "Secret"), f"{path} defines a Secret"
    for kind in KINDS:
        for container in ray_containers(kind):
            for name, entry in env_of(container).items():
                if SECRET_WORDS.search(name):
                    assert "value" not in entry and "secretKeyRef" in entry["valueFrom"], (kind, name)
    for kind in ("RayCluster", "RayService"):  # the clusters that serve the API
        for container in ray_containers(kind):
            ref = env_of(container)["CS3_SERVE_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "cs3ray-serve-token", "key": "token"}
    # Serve logs an application's args, and the RayService object shows its runtime_env: no token in either.
    for app in serve_config()["applications"]:
        named = [*app.get("args", {}), *app.get("runtime_env", {}).get("env_vars", {})]
        assert not any(SECRET_WORDS.search(key) for key in named)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_ray_container_has_resources_and_probes(kind):
    for container in ray_containers(kind):
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][bound]), (kind, container["name"])
        ports = {p["containerPort"] for p in container.get("ports", [])} | {52365}  # the dashboard agent's
        for probe in ("readinessProbe", "livenessProbe"):
            check = container[probe]["httpGet"]
            assert check["port"] in ports and check["path"] in ("/api/healthz", "/-/healthz"), (kind, probe)


def test_serving_cluster_sets_the_switches_of_deploy_readme():
    """The RayService sets what cs3ray's own serving clusters set (cs3ray/ops/cluster_env.py)."""
    wanted = {**CLUSTER_ENV, **SERVING_CLUSTER_ENV,
              "RAY_SERVE_ENABLE_HA_PROXY": HAPROXY_ENV["RAY_SERVE_ENABLE_HA_PROXY"]}
    readme = (DEPLOY / "README.md").read_text()
    for container in ray_containers("RayService"):
        env = {name: entry.get("value") for name, entry in env_of(container).items()}
        assert wanted.items() <= env.items()
    assert all(name in readme for name in wanted)
    # A shared cluster gets the switch that is safe for any Serve app; training clusters none.
    for container in ray_containers("RayCluster"):
        assert env_of(container)["RAY_SERVE_PROXY_USE_GRPC"]["value"] == CLUSTER_ENV["RAY_SERVE_PROXY_USE_GRPC"]
        assert "RAY_worker_niceness" not in env_of(container)
    for container in ray_containers("RayJob"):
        assert not [name for name in env_of(container) if name.startswith(("RAY_SERVE", "RAY_worker"))]


def rayjob_command() -> list[str]:
    return shlex.split(MANIFESTS["RayJob"][1]["spec"]["entrypoint"])


def serve_config() -> dict:
    return yaml.safe_load(MANIFESTS["RayService"][1]["spec"]["serveConfigV2"])


def test_rayjob_runs_jobs_train_with_a_config_that_loads():
    python, script, config, *overrides = rayjob_command()
    assert (python, script) == ("python", "jobs/train.py") and (ROOT / script).is_file()
    cfg = load_config(ROOT / config, overrides)
    # The RayService serves the run this job writes, from storage every pod reaches.
    assert cfg.run.dir == serve_config()["applications"][0]["args"]["run"]
    assert cfg.run.dir.startswith("s3://") and cfg.data.cache_dir.startswith("s3://")


def test_rayservice_serve_config_builds_the_cs3ray_app(tmp_path, monkeypatch):
    """serveConfigV2 is a valid Serve config whose import_path imports (with the repository root on
    the path, as the image's PYTHONPATH has it) and builds the app from its args, as Serve does."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    config = serve_config()
    ServeDeploySchema.model_validate(config)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    (app,) = config["applications"]
    monkeypatch.syspath_prepend(str(ROOT))
    builder = import_attr(app["import_path"])
    args = {**app["args"], "run": str(tmp_path / "run")}  # a local checkpoint in place of the bucket's
    make_checkpoint(tmp_path / "run", overrides=["serve.num_cpus=0.5"])
    monkeypatch.setenv("CS3_SERVE_TOKEN", "s3cret-token")
    built = call_user_app_builder_with_args_if_necessary(builder, args)
    deployment = built._bound_deployment
    assert deployment.name == "tiny-llm" and deployment.ray_actor_options["num_cpus"] == 0.5
    spec = deployment.init_args[0]
    assert spec.token == "s3cret-token" and spec.follow is True and spec.run == str(tmp_path / "run")
    # Without the Secret's variable the proxy (on every interface) would serve an open API: refused.
    monkeypatch.delenv("CS3_SERVE_TOKEN")
    with pytest.raises(UserError, match="without a token"):
        call_user_app_builder_with_args_if_necessary(builder, args)
    with pytest.raises(pydantic.ValidationError, match="token"):  # an unknown arg (a token too) is refused
        call_user_app_builder_with_args_if_necessary(builder, {**args, "token": "x"})


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped as Docker does."""
    out, current = [], ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context."""
    found = []
    for word, rest in dockerfile():
        if word == "COPY":
            parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
            if any(p.startswith("--from") for p in parts):
                continue
            parts = [p for p in parts if not p.startswith("--")]
            found.append((parts[:-1], parts[-1]))
    return found


def dockerignored(path: str) -> bool:
    patterns = [line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)


def test_dockerfile_copies_only_what_exists_and_its_entrypoint_is_a_script():
    instructions = dockerfile()
    workdir = [rest for word, rest in instructions if word == "WORKDIR"][-1]
    sources = {}  # path in the image -> path in the repository
    for srcs, dest in copies():
        dest = posixpath.join(workdir, dest)
        for src in srcs:
            assert (ROOT / src).exists() and not dockerignored(src), src
            into_dir = dest.endswith("/") or len(srcs) > 1
            sources[posixpath.normpath(posixpath.join(dest, posixpath.basename(src)) if into_dir else dest)] = src
    # Everything the manifests and the compose file run from the image is copied in.
    for name in ("jobs", "configs", "cs3ray", "cli", "pyproject.toml", "README.md"):
        assert sources.get(posixpath.join(workdir, name)) == name
    (entrypoint,) = [json.loads(rest) for word, rest in instructions if word == "ENTRYPOINT"]
    script = ROOT / sources[entrypoint[0]]
    assert os.access(script, os.X_OK) and script.read_text().startswith("#!/usr/bin/env bash")
    (cmd,) = [json.loads(rest) for word, rest in instructions if word == "CMD"]
    assert cmd[0] in {ep.name for ep in DIST.entry_points if ep.group == "console_scripts"}
    # Serve imports jobs.serve_app from the repository root; the process runs as a non-root user.
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    assert f"PYTHONPATH={workdir}" in env.split()
    user = [rest for word, rest in instructions if word == "USER"][-1]
    assert user not in ("root", "0")


def test_dockerfile_installs_torch_as_pyproject_and_the_variants_need():
    text = " ".join(rest for _, rest in dockerfile())
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", (DEPLOY / "Dockerfile").read_text(), re.M))
    assert args["VARIANT"] == "cpu" and "cpu)" in text and "cuda)" in text
    assert "https://download.pytorch.org/whl/cpu" in text  # the CPU build, not PyPI's CUDA one
    torch_req = next(r for r in map(Requirement, DIST.requires) if r.name == "torch" and not r.marker)
    assert torch_req.specifier.contains(args["TORCH_VERSION"])
    assert args["TORCH_VERSION"] == torch.__version__.split("+")[0]  # the tested one
    assert re.search(r'pip install "\.\$\{EXTRAS', text)  # the repository itself, with pyproject's deps


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_starts_a_head_and_a_worker_with_token_auth():
    spec = compose()
    services = spec["services"]
    heads = [name for name, s in services.items() if s["command"][:3] == ["ray", "start", "--head"]]
    (head,) = heads
    port = next(a.split("=")[1] for a in services[head]["command"] if a.startswith("--port="))
    workers = [s for name, s in services.items() if name != head]
    assert workers and all(f"--address={head}:{port}" in s["command"] for s in workers)
    for name, service in services.items():
        build = service["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert context == ROOT and (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        env = service["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        assert not any(SECRET_WORDS.search(k) and not k.endswith(("_FILE", "_PATH")) for k in env if k != "RAY_AUTH_MODE")
        mounted = {f"/run/secrets/{s}" for s in service["secrets"]}
        assert env["RAY_AUTH_TOKEN_PATH"] in mounted and env["CS3_SERVE_TOKEN_FILE"] in mounted
    # The shared volumes are mounted on the image's directories the ray user owns.
    workdir = [rest for word, rest in dockerfile() if word == "WORKDIR"][-1]
    owned = re.search(r"install -d -o ray -g ray ([^&]+)", " ".join(rest for _, rest in dockerfile())).group(1).split()
    mounts = {v.split(":")[1] for s in services.values() for v in s["volumes"]}
    assert mounts == {posixpath.join(workdir, d) for d in owned}
    # The secret files are the user's: kept out of git and out of the image.
    ignored = (DEPLOY / ".gitignore").read_text().split()
    for secret in spec["secrets"].values():
        rel = Path(secret["file"])
        assert rel.parts[0] + "/" in ignored and dockerignored(f"deploy/{rel.parts[0]}")
    assert "CS3_SERVE_TOKEN" in (DEPLOY / "entrypoint.sh").read_text()


def test_images_named_are_the_ones_deploy_builds():
    version = DIST.version
    images = {c["image"] for kind in KINDS for c in ray_containers(kind)}
    assert images <= {f"cs3ray:{version}-cpu", f"cs3ray:{version}-cuda"}
    assert compose()["x-node"]["image"].startswith(f"cs3ray:{version}-")
