"""The Kubernetes files in k8s/: every manifest is a valid KubeRay v1.7.0 resource (the CRD schemas in
../shared/kuberay, validated the way the API server and the operator do), and the manifests, the
Dockerfile and pyproject.toml agree on the Ray version.

How the manifests are checked (see ../shared/kuberay/README.md):
- null-valued keys are dropped and schema `default`s filled in before `required` is checked, as the
  API server does (otherwise e.g. a worker group without minReplicas would fail);
- the schema copy used has `additionalProperties: false` on every object that declares `properties`,
  so a misspelt field is an error instead of being silently pruned;
- integers must be ints (never floats: `cpu: 0.5` is rejected, `"500m"` is not), int32 fields in range;
- apiVersion, kind, metadata.name and the rules that live only in the operator's Go code are checked here.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"

import importlib.util  # noqa: E402 - k8s/render.py is a script beside the manifests, not a package

_spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)
SCHEMA_DIR = Path(__file__).resolve().parents[2] / "shared" / "kuberay"
RAYJOB_FILE = K8S / "rayjob-gpu.yaml"
RAYCLUSTER_FILE = K8S / "raycluster.yaml"
DOCKERFILE = K8S / "Dockerfile"
MANIFESTS = sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")])

API_VERSION = "ray.io/v1"
SCHEMA_FILES = {"RayJob": "rayjob.v1.schema.json", "RayCluster": "raycluster.v1.schema.json",
                "RayService": "rayservice.v1.schema.json"}
NAME_MAX = {"RayJob": 47, "RayService": 47, "RayCluster": 53}  # KubeRay's Max*NameLength
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
GPU = "nvidia.com/gpu"


# ----------------------------------------------------------------------------------------------
# Reading the project's files


def load_docs(path: Path) -> list[Any]:
    """Every YAML document of a file (empty documents, e.g. after a trailing `---`, left out)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load_doc(path: Path) -> dict:
    docs = load_docs(path)
    assert len(docs) == 1, f"{path.name}: expected one YAML document, found {len(docs)}"
    return docs[0]


def ray_range() -> tuple[str, str]:
    """(X, Y) of the `ray[...]>=X,<Y` dependency in pyproject.toml."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(r"ray\[[^\]]*\]\s*>=\s*(\d+(?:\.\d+)*)\s*,\s*<\s*(\d+(?:\.\d+)*)", dep.strip())
        if m:
            return m.group(1), m.group(2)
    raise AssertionError(f"no `ray[...]>=X,<Y` dependency in pyproject.toml: {deps}")


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def image_ray_version() -> str:
    """The one build argument: k8s/Dockerfile's `ARG RAY_VERSION=` default (k8s/render.py)."""
    return render.default_version()


def pinned_ray_version() -> str:
    """The Ray version of the image and the committed manifests, checked to lie in pyproject's range."""
    v, (lo, hi) = image_ray_version(), ray_range()
    assert version_key(lo) <= version_key(v) < version_key(hi), \
        f"k8s/Dockerfile RAY_VERSION {v} is outside pyproject.toml's Ray range >={lo},<{hi}"
    return v


def min_python() -> tuple[int, int]:
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert m, f"requires-python {spec!r} is not of the form >=X.Y"
    return int(m.group(1)), int(m.group(2))


def dockerfile_base_image() -> str:
    """The final stage's FROM image, with ${ARG}s before the first FROM substituted."""
    args: dict[str, str] = {}
    image = None
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() == "ARG" and image is None and "=" in words[1]:
            name, _, value = words[1].partition("=")
            args[name] = value.strip("\"'")
        elif words[0].upper() == "FROM":
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], words[1])
    assert image, "k8s/Dockerfile has no FROM line"
    return image


def image_tag(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else "latest"


def has_version(tag: str, version: str) -> bool:
    """`version` appears in the tag as a whole version (2.60.0 is in '2.60.0-gpu', not in '2.60.01')."""
    return re.search(rf"(?<![\d.]){re.escape(version)}(?![\d.])", tag) is not None


# ----------------------------------------------------------------------------------------------
# Walking Ray resources


def cluster_specs(doc: dict) -> list[dict]:
    """The RayCluster specs a resource creates (a RayJob in clusterSelector mode creates none)."""
    spec = doc.get("spec") or {}
    if doc.get("kind") == "RayCluster":
        return [spec]
    key = {"RayJob": "rayClusterSpec", "RayService": "rayClusterConfig"}.get(doc.get("kind"))
    return [spec[key]] if key and spec.get(key) is not None else []


def ray_groups(cluster: dict) -> Iterator[tuple[str, dict]]:
    """(group name, group spec) for the head ('head') and every worker group."""
    yield "head", cluster.get("headGroupSpec") or {}
    for group in cluster.get("workerGroupSpecs") or []:
        yield str(group.get("groupName")), group


def pod_spec(group: dict) -> dict:
    return (group.get("template") or {}).get("spec") or {}


def ray_container(group: dict) -> dict:
    """KubeRay runs Ray in the first container of each pod template."""
    containers = pod_spec(group).get("containers") or [{}]
    return containers[0]


def worker_group(doc: dict, name: str | None = None) -> dict:
    groups = [g for n, g in ray_groups(cluster_specs(doc)[0]) if n != "head" and (name is None or n == name)]
    assert groups, f"{doc['metadata']['name']}: no worker group {name or ''}"
    return groups[0]


def gpus(container: dict, kind: str = "limits") -> int:
    value = ((container.get("resources") or {}).get(kind) or {}).get(GPU, 0)
    return int(value)


# ----------------------------------------------------------------------------------------------
# The validator


def _is_int(checker, value) -> bool:  # JSON Schema counts 1.0 as an integer; Kubernetes quantities do not
    return isinstance(value, int) and not isinstance(value, bool)


_FORMATS = jsonschema.FormatChecker(formats=())
_FORMATS.checks("int32")(lambda v: not _is_int(None, v) or -(2**31) <= v < 2**31)
_FORMATS.checks("int64")(lambda v: not _is_int(None, v) or -(2**63) <= v < 2**63)
_Validator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, type_checker=jsonschema.Draft7Validator.TYPE_CHECKER.redefine("integer", _is_int))


def strict_schema(schema: dict) -> dict:
    """A copy with additionalProperties: false on every object that declares properties (catches typos)."""
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: strict_schema(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict_schema(s) for s in out[key]]
    return out


def as_stored(value: Any, schema: dict | None) -> Any:
    """What the API server stores: keys with null values dropped (unless nullable), then the schema's
    defaults filled in for absent fields of every object present, recursively."""
    if not schema:
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if item is None and not (sub or {}).get("nullable"):
                continue
            out[key] = as_stored(item, sub)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = as_stored(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [as_stored(item, schema["items"]) for item in value]
    return value


@dataclass(frozen=True)
class CRD:
    schema: dict
    validator: jsonschema.protocols.Validator


def _path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "<root>"


def schema_problems(doc: dict, crd: CRD) -> list[str]:
    errors = crd.validator.iter_errors(as_stored(doc, crd.schema))
    errors = sorted(errors, key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_path(e)}: {e.message}" for e in errors]


def cluster_problems(cluster: dict, where: str) -> list[str]:
    out = []
    names = [n for n, _ in ray_groups(cluster)]
    if len(set(names)) != len(names):
        out.append(f"{where}: group names are not unique: {names}")
    for name, group in ray_groups(cluster):
        at = f"{where} group {name}"
        if not pod_spec(group).get("containers"):
            out.append(f"{at}: the pod template has no container")
        params = group.get("rayStartParams") or {}
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
            out.append(f"{at}: resources set both in rayStartParams and in the group's `resources`")
        if "labels" in params:
            out.append(f"{at}: rayStartParams['labels'] is not supported; use the group's `labels`")
        if name == "head":
            continue
        lo, hi = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        if lo < 0 or hi < 0:
            out.append(f"{at}: negative minReplicas/maxReplicas ({lo}, {hi})")
        if lo > hi:
            out.append(f"{at}: minReplicas {lo} > maxReplicas {hi}")
    return out


def operator_problems(doc: dict) -> list[str]:
    """The rules KubeRay's Go code enforces (utils/validation.go) but the CRD schema does not."""
    out = []
    spec = doc.get("spec") or {}
    if doc["kind"] == "RayJob":
        shutdown = spec.get("shutdownAfterJobFinishes", False)
        ttl = spec.get("ttlSecondsAfterFinished", 0)
        if ttl < 0:
            out.append("spec.ttlSecondsAfterFinished must be >= 0")
        if ttl > 0 and not shutdown:
            out.append("spec.ttlSecondsAfterFinished > 0 needs spec.shutdownAfterJobFinishes: true")
        if spec.get("suspend") and not shutdown:
            out.append("spec.suspend needs spec.shutdownAfterJobFinishes: true")
        has_cluster, has_selector = spec.get("rayClusterSpec") is not None, bool(spec.get("clusterSelector"))
        if has_cluster == has_selector:
            out.append("spec: exactly one of rayClusterSpec and clusterSelector must be set")
        if has_selector and not spec["clusterSelector"].get("ray.io/cluster"):
            out.append("spec.clusterSelector needs a non-empty 'ray.io/cluster'")
        mode = spec.get("submissionMode")
        if mode not in SUBMISSION_MODES:
            out.append(f"spec.submissionMode {mode!r} is not one of {sorted(SUBMISSION_MODES)}")
        if mode != "InteractiveMode" and not (spec.get("entrypoint") or "").strip():
            out.append(f"spec.entrypoint is empty (needed in {mode})")
        try:
            runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "")
        except yaml.YAMLError as e:
            out.append(f"spec.runtimeEnvYAML is not valid YAML: {e}")
        else:
            if runtime_env is not None and not isinstance(runtime_env, dict):
                out.append(f"spec.runtimeEnvYAML must be a YAML mapping, got {type(runtime_env).__name__}")
        for key in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
            if key in spec and spec[key] <= 0:
                out.append(f"spec.{key} must be > 0")
        if spec.get("backoffLimit", 0) < 0:
            out.append("spec.backoffLimit must be >= 0")
    for cluster in cluster_specs(doc):
        out += cluster_problems(cluster, "cluster")
    return out


def problems(doc: Any, crds: dict[str, CRD]) -> list[str]:
    """Everything the API server or the operator would reject in one manifest ([] when valid)."""
    if not isinstance(doc, dict):
        return [f"a manifest must be a mapping, got {type(doc).__name__}"]
    out = []
    if doc.get("apiVersion") != API_VERSION:
        out.append(f"apiVersion {doc.get('apiVersion')!r} is not {API_VERSION!r}")
    kind = doc.get("kind")
    if kind not in crds:
        return out + [f"kind {kind!r} is not one of {sorted(crds)}"]
    name = (doc.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not DNS1035.fullmatch(name):
        out.append(f"metadata.name {name!r} is not a DNS-1035 label (lower case letters, digits, '-')")
    elif len(name) > NAME_MAX[kind]:
        out.append(f"metadata.name {name!r} is longer than {NAME_MAX[kind]} characters (the {kind} limit)")
    found = schema_problems(doc, crds[kind])
    if not found:  # the operator's rules assume the shapes the schema guarantees
        found = operator_problems(as_stored(doc, crds[kind].schema))
    return out + found


@pytest.fixture(scope="session")
def crds() -> dict[str, CRD]:
    if not SCHEMA_DIR.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMA_DIR} (shared/kuberay beside the repository): "
                    "the k8s/ manifests cannot be validated without them")
    out = {}
    for kind, file in SCHEMA_FILES.items():
        schema = json.loads((SCHEMA_DIR / file).read_text())
        out[kind] = CRD(schema, _Validator(strict_schema(schema), format_checker=_FORMATS))
    return out


@pytest.fixture(scope="session")
def rayjob_doc() -> dict:
    return load_doc(RAYJOB_FILE)


@pytest.fixture
def rayjob(rayjob_doc) -> dict:
    """A fresh copy of k8s/rayjob-gpu.yaml to change."""
    return copy.deepcopy(rayjob_doc)


# ----------------------------------------------------------------------------------------------
# The manifests are valid


def test_expected_files_exist():
    for path in (RAYJOB_FILE, RAYCLUSTER_FILE, DOCKERFILE):
        assert path.is_file(), f"{path.relative_to(REPO)} is missing"
    assert load_doc(RAYJOB_FILE)["kind"] == "RayJob"
    assert load_doc(RAYCLUSTER_FILE)["kind"] == "RayCluster"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(path, crds):
    docs = load_docs(path)
    assert docs, f"{path.name} holds no YAML document"
    for i, doc in enumerate(docs):
        found = problems(doc, crds)
        assert not found, f"{path.name} document {i}:\n  " + "\n  ".join(found)


# ----------------------------------------------------------------------------------------------
# The manifests and the image follow the project


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_ray_version_matches_pyproject(path):
    check_ray_version(path.name, load_docs(path), pinned_ray_version())


@pytest.mark.parametrize("which", ["oldest", "newest"])
def test_manifests_rendered_for_every_supported_ray_are_valid(which, crds, tmp_path):
    """k8s/render.py with the oldest supported Ray (pyproject's lower bound) and the image's: every
    rayVersion and image tag follows the one argument, and the manifests stay valid."""
    version = ray_range()[0] if which == "oldest" else image_ray_version()
    assert render.main(["--ray-version", version, "--out", str(tmp_path)]) == 0
    for path in MANIFESTS:
        docs = load_docs(tmp_path / path.name)
        check_ray_version(path.name, docs, version)
        for doc in docs:
            assert problems(doc, crds) == [], path.name
        assert render.render(path.read_text(), pinned_ray_version()) == path.read_text(), \
            f"{path.name} is not the rendering for the Dockerfile's RAY_VERSION: run k8s/render.py --out k8s"


def check_ray_version(name: str, docs: list, ray: str) -> None:
    for doc in docs:
        for cluster in cluster_specs(doc):
            assert str(cluster.get("rayVersion")) == ray, \
                f"{name}: rayVersion {cluster.get('rayVersion')!r} != {ray} (k8s/Dockerfile RAY_VERSION)"
            for group_name, group in ray_groups(cluster):
                image = ray_container(group).get("image", "")
                assert has_version(image_tag(image), ray), \
                    f"{name} group {group_name}: image {image!r} has no tag with Ray {ray} (k8s/Dockerfile RAY_VERSION)"


def test_one_image_for_all_manifests():
    images = {ray_container(g).get("image") for p in MANIFESTS for d in load_docs(p)
              for c in cluster_specs(d) for _, g in ray_groups(c)}
    assert len(images) == 1, f"the manifests use different images: {sorted(map(str, images))}"


def test_dockerfile_base_image_is_the_ray_gpu_image_of_the_pinned_version():
    image = dockerfile_base_image()
    m = re.fullmatch(r"rayproject/ray:(?P<ray>\d+\.\d+\.\d+)(?:-py(?P<py>\d)(?P<minor>\d+))?(?:-[\w.]+)*-gpu", image)
    assert m, f"k8s/Dockerfile FROM {image!r} is not a rayproject/ray:<version>[-pyXY]-gpu image"
    ray = pinned_ray_version()
    assert m["ray"] == ray, f"k8s/Dockerfile FROM {image} != Ray {ray} (pyproject.toml)"
    if m["py"]:
        assert (int(m["py"]), int(m["minor"])) >= min_python(), f"{image}: Python older than requires-python"


def test_dockerfile_installs_the_project_in_app():
    text = DOCKERFILE.read_text()
    assert re.search(r"^WORKDIR\s+/app\s*$", text, re.M), "k8s/Dockerfile must set WORKDIR /app"
    assert re.search(r"pip install\b[^\n]*\s\.(\s|$)", text), "k8s/Dockerfile must `pip install .` the project"
    for line in re.findall(r"^COPY\s+(.+)$", text, re.M):
        sources = [w for w in line.split() if not w.startswith("--")][:-1]
        for src in sources:
            assert (REPO / src).exists(), f"k8s/Dockerfile copies {src}, which is not in the repository"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_head_runs_no_ray_tasks(path):
    for doc in load_docs(path):
        for cluster in cluster_specs(doc):
            params = cluster["headGroupSpec"].get("rayStartParams") or {}
            assert params.get("num-cpus") == "0", f"{path.name}: head rayStartParams num-cpus must be \"0\""


@pytest.mark.parametrize("path", [RAYJOB_FILE, RAYCLUSTER_FILE], ids=lambda p: p.name)
def test_gpu_worker_group(path):
    doc = load_doc(path)
    groups = [g for n, g in ray_groups(cluster_specs(doc)[0]) if n != "head" and gpus(ray_container(g)) >= 1]
    assert groups, f"{path.name}: no worker group with {GPU} limits"
    for group in groups:
        container = ray_container(group)
        assert gpus(container, "requests") in (0, gpus(container)), \
            f"{path.name} group {group['groupName']}: {GPU} requests must equal limits"
        tolerations = pod_spec(group).get("tolerations") or []
        assert any(t.get("key") == GPU and t.get("effect") in (None, "NoSchedule") for t in tolerations), \
            f"{path.name} group {group['groupName']}: no toleration for {GPU}:NoSchedule"


def test_raycluster_head_ports():
    head = ray_container(load_doc(RAYCLUSTER_FILE)["spec"]["headGroupSpec"])
    ports = {p["containerPort"]: p.get("name") for p in head.get("ports", [])}
    assert {6379, 8265, 10001} <= set(ports), f"head ports {ports}: need gcs 6379, dashboard 8265, client 10001"


def test_rayjob_lifecycle(rayjob_doc):
    spec = rayjob_doc["spec"]
    assert spec.get("submissionMode") == "K8sJobMode"
    assert spec.get("shutdownAfterJobFinishes") is True and spec.get("ttlSecondsAfterFinished", 0) > 0
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert "working_dir" not in runtime_env, "the code is in the image: no working_dir in runtimeEnvYAML"
    env_vars = runtime_env.get("env_vars") or {}
    assert all(isinstance(v, str) for v in env_vars.values()), f"runtime env env_vars must be strings: {env_vars}"


def entrypoint_commands(entrypoint: str) -> list[list[str]]:
    """The entrypoint's commands (split on && and ;), each as argv."""
    commands, current = [], []
    for word in shlex.split(entrypoint):
        if word in ("&&", ";"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in [*commands, current] if c]


def config_flags(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    """(--config value, {'section.key': raw value}) of a `python -m pipeline CMD ...` / `-m jobs.X ...` argv."""
    assert argv[:2] == ["python", "-m"], f"entrypoint command {argv} is not `python -m MODULE ...`"
    module, rest = argv[2], argv[3:]
    if module == "pipeline":
        rest = rest[1:]
    else:
        assert module.startswith("jobs.") and (REPO / "jobs" / f"{module[5:]}.py").is_file(), \
            f"entrypoint runs module {module}, which is neither `pipeline` nor a file in jobs/"
    config, flags, i = None, {}, 0
    while i < len(rest):
        word = rest[i]
        if word in ("--debug", "--overwrite"):
            i += 1
            continue
        assert word.startswith("--") and i + 1 < len(rest), f"unexpected entrypoint argument {word!r} in {argv}"
        if word == "--config":
            config = rest[i + 1]
        else:
            flags[word[2:]] = rest[i + 1]
        i += 2
    return config, flags


def test_rayjob_entrypoint_uses_gpus_and_valid_config_flags(rayjob_doc):
    from pipeline import config as config_mod
    from pipeline.errors import ConfigError

    commands = entrypoint_commands(rayjob_doc["spec"]["entrypoint"])
    assert any(c[:3] == ["python", "-m", "jobs.train"] for c in commands), "the RayJob must run `python -m jobs.train`"
    known = config_mod.keys()
    for argv in commands:
        config_file, flags = config_flags(argv)
        assert config_file and (REPO / config_file).is_file(), f"{argv}: --config {config_file} is not in the repo"
        unknown = sorted(set(flags) - set(known))
        assert not unknown, f"{argv}: unknown config flags {unknown}"
        overrides = {k: config_mod.parse_flag_value(v) for k, v in flags.items()}
        try:
            cfg = config_mod.load(REPO / config_file, overrides)
        except ConfigError as e:
            if "train.use_gpu" in str(e) and overrides.get("train.use_gpu") is True:
                pytest.xfail("pipeline/config.py rejects `--train.use_gpu true` (read as the TOML boolean true) "
                             f"although the README documents it: {e}")
            raise
        if argv[2] == "jobs.train":
            assert cfg.train.use_gpu == "true", "the GPU RayJob must pass --train.use_gpu true"
            group = worker_group(rayjob_doc)
            total = group["replicas"] * gpus(ray_container(group))
            assert total >= cfg.train.num_workers, \
                f"--train.num_workers {cfg.train.num_workers} needs that many GPUs; the cluster has {total}"


def test_readme_commands_name_the_manifests():
    readme = next((p for p in (K8S / "README.md", REPO / "docs" / "deploy.md", REPO / "README.md")
                   if p.is_file() and "Run on Kubernetes" in p.read_text()), None)
    if readme is None:
        pytest.skip("no 'Run on Kubernetes' section in k8s/README.md, docs/deploy.md or README.md")
    text = readme.read_text()
    job, cluster = load_doc(RAYJOB_FILE)["metadata"]["name"], load_doc(RAYCLUSTER_FILE)["metadata"]["name"]
    for needle in (f"rayjob {job}", f"svc/{cluster}-head-svc", "--version 1.7.0", "-f k8s/Dockerfile",
                   f"parquet-ray-pipeline:{pinned_ray_version()}-gpu"):
        assert needle in text, f"the Kubernetes instructions do not mention {needle!r}"


# ----------------------------------------------------------------------------------------------
# The validator: accepts what the API server accepts, rejects what it (or the operator) rejects


DELETE = object()  # as a value for _set: remove the key
HEAD = "spec.rayClusterSpec.headGroupSpec"
WORKER = "spec.rayClusterSpec.workerGroupSpecs.0"
WORKER_RES = f"{WORKER}.template.spec.containers.0.resources"


def _node(doc: dict, parents: list[str]) -> Any:
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A change to a manifest: set the value at a dotted path (list indexes as numbers; value DELETE removes)."""
    *parents, last = path.split(".")

    def change(doc: dict) -> None:
        node = _node(doc, parents)
        if value is DELETE:
            del node[last]
        else:
            node[last] = copy.deepcopy(value)
    return change


def _rename(path: str, new: str) -> Callable[[dict], None]:
    *parents, old = path.split(".")

    def change(doc: dict) -> None:
        node = _node(doc, parents)
        node[new] = node.pop(old)
    return change


REJECTED = {  # change -> a piece of the expected message
    "misspelt-field": ([_rename("spec.shutdownAfterJobFinishes", "shutdownAfterJobFinish")], "shutdownAfterJobFinish"),
    "misspelt-pod-field": ([_rename(f"{WORKER}.template.spec.tolerations", "toleration")], "toleration"),
    "float-cpu": ([_set(f"{WORKER_RES}.limits.cpu", 0.5)], "cpu"),
    "float-integer": ([_set("spec.ttlSecondsAfterFinished", 600.0)], "ttlSecondsAfterFinished"),
    "bad-quantity": ([_set(f"{WORKER_RES}.requests.memory", "32 GB")], "memory"),
    "int32-overflow": ([_set("spec.ttlSecondsAfterFinished", 2**31)], "ttlSecondsAfterFinished"),
    "ttl-without-shutdown": ([_set("spec.shutdownAfterJobFinishes", DELETE)], "shutdownAfterJobFinishes"),
    "suspend-without-shutdown": ([_set("spec.shutdownAfterJobFinishes", False), _set("spec.ttlSecondsAfterFinished", 0),
                                  _set("spec.suspend", True)], "suspend"),
    "min-above-max": ([_set(f"{WORKER}.minReplicas", 3), _set(f"{WORKER}.maxReplicas", 2)],
                      "minReplicas 3 > maxReplicas 2"),
    "ray-start-param-not-string": ([_set(f"{HEAD}.rayStartParams.num-cpus", 0)], "num-cpus"),
    "no-cluster": ([_set("spec.rayClusterSpec", DELETE)], "exactly one of rayClusterSpec and clusterSelector"),
    "cluster-and-selector": ([_set("spec.clusterSelector", {"ray.io/cluster": "x"})], "exactly one of"),
    "runtime-env-not-yaml": ([_set("spec.runtimeEnvYAML", "env_vars: {RAY_DEDUP_LOGS: '1'")], "runtimeEnvYAML"),
    "submission-mode": ([_set("spec.submissionMode", "K8sMode")], "submissionMode"),
    "missing-group-name": ([_set(f"{WORKER}.groupName", DELETE)], "groupName"),
    "no-containers": ([_set(f"{WORKER}.template.spec.containers", [])], "no container"),
    "name-too-long": ([_set("metadata.name", "a" * 48)], "longer than 47"),
    "name-not-dns-1035": ([_set("metadata.name", "Train_GPU")], "DNS-1035"),
    "api-version": ([_set("apiVersion", "ray.io/v1alpha1")], "apiVersion"),
    "kind": ([_set("kind", "RayJobs")], "kind"),
}


@pytest.mark.parametrize("changes, expected", REJECTED.values(), ids=REJECTED.keys())
def test_validator_rejects(rayjob, crds, changes, expected):
    assert not problems(rayjob, crds), "the unchanged manifest must be valid for this test to mean anything"
    for change in changes:
        change(rayjob)
    found = problems(rayjob, crds)
    assert found, "the broken manifest was accepted"
    assert any(expected in p for p in found), f"expected a problem about {expected!r}, got {found}"


ACCEPTED = {  # what the API server accepts although a plain JSON Schema check would not
    "defaulted-min-max-replicas": [_set(f"{WORKER}.minReplicas", DELETE), _set(f"{WORKER}.maxReplicas", DELETE)],
    "null-value-dropped": [_set(f"{HEAD}.template.metadata", None), _set("spec.suspend", None)],
    "milli-cpu-string": [_set(f"{WORKER_RES}.requests.cpu", "500m")],
    "integer-quantity": [_set(f"{WORKER_RES}.limits.cpu", 8), _set(f"{WORKER_RES}.requests.cpu", 8)],
    "cluster-selector-mode": [_set("spec.rayClusterSpec", DELETE),
                              _set("spec.clusterSelector", {"ray.io/cluster": "parquet-pipeline"})],
}


@pytest.mark.parametrize("changes", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_validator_accepts(rayjob, crds, changes):
    for change in changes:
        change(rayjob)
    assert problems(rayjob, crds) == []
