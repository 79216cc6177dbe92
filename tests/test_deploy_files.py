"""deploy/'s deployment files are checked, not just shipped (issue 23, point 4):

- the Kubernetes manifests (deploy/kubernetes/, plain YAML, no templating) validate against
  the Kubernetes JSON schemas with kubeconform in strict mode, for two Kubernetes versions;
- what they say agrees with the code: every container's command line parses with
  trainguard's own parser, the metrics ports are the services' ports, the ConfigMap passes
  `trainguard config check`, the RBAC is exactly what the Kubernetes driver calls, the node
  agent gets exactly the privileges stack capture needs (and the kmsg variant only adds what
  reading /dev/kmsg needs), the signing key reaches only the services that hold it;
- the container image definition (deploy/Containerfile) has its stages, a non-root user and
  the `trainguard` entrypoint;
- the systemd units pass `systemd-analyze verify`, the Slurm prolog/epilog `bash -n` and
  shellcheck, and the prolog/epilog start and stop the agent as documented.

kubeconform and the schemas (PyPI's kubernetes-validate wheel, read in place) are installed
by scripts/deploy_tools.sh, which `make test` runs; shellcheck and systemd-analyze by
scripts/test.sh from Debian. A test whose tool is missing skips, saying how to get it.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
SLURM = DEPLOY / "slurm"
TOOLS = Path(os.environ.get("TRAINGUARD_HOME") or Path.home() / ".cache" / "trainguard") / "bin"
KUBECONFORM_VERSION = "v0.8.0"      # scripts/deploy_tools.sh installs these two
SCHEMAS_VERSION = "1.37.0"          # kubernetes-validate: schemas of Kubernetes 1.25 to 1.37
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
INSTALL_HINT = "run scripts/deploy_tools.sh (make test does)"


# ------------------------------------------------------------------------------ helpers
def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents(include_variants: bool = False) -> list[dict]:
    return [d for p in manifest_files() if include_variants or "variants" not in p.parts
            for d in documents(p)]


def find(kind: str, name: str, docs=None) -> dict:
    hits = [d for d in (docs or all_documents()) if d["kind"] == kind
            and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def parse_trainguard(argv: list[str]):
    """``argv`` (after ``trainguard``) through trainguard's own parser; fails the test with
    argparse's message when it refuses them."""
    from trainguard.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"trainguard {shlex.join(argv)} is refused: {err.getvalue().strip()}")


def workloads() -> list[dict]:
    return [d for d in all_documents(include_variants=True)
            if d["kind"] in ("Deployment", "DaemonSet", "Job")]


# --------------------------------------------------------------------- kubeconform
def kubeconform() -> str:
    exe = TOOLS / "kubeconform"
    stamp = TOOLS / "kubeconform.version"
    if exe.is_file() and os.access(exe, os.X_OK):
        if stamp.is_file() and stamp.read_text().strip() != KUBECONFORM_VERSION:
            pytest.skip(f"{exe} is {stamp.read_text().strip()}, not {KUBECONFORM_VERSION}: "
                        f"{INSTALL_HINT}")
        return str(exe)
    on_path = shutil.which("kubeconform")
    if on_path:
        return on_path
    pytest.skip(f"kubeconform is not installed in {TOOLS}: {INSTALL_HINT}")


def _refs(node, out: set) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.add(ref.rsplit("/", 1)[-1])
        for value in node.values():
            _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)


def _local(node):
    """Refs into _definitions.json made local (``#/$defs/NAME``)."""
    if isinstance(node, dict):
        return {k: (re.sub(r"^.*_definitions\.json#", "#", v) if k == "$ref"
                    and isinstance(v, str) else _local(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_local(v) for v in node]
    return node


def standalone_schemas(out: Path, version: str, kinds: set[str]) -> Path:
    """kubeconform's layout (``v<version>-standalone-strict/<kind>-<group>-<version>.json``)
    from kubernetes-validate's ``v<version>-local-strict`` schemas, whose refs point into a
    shared ``_definitions.json``: each schema gets the definitions it reaches as ``$defs``."""
    wheel = TOOLS / f"kubernetes_validate-{SCHEMAS_VERSION}-py3-none-any.whl"
    if not wheel.is_file():
        pytest.skip(f"the Kubernetes schemas ({wheel.name}) are not in {TOOLS}: {INSTALL_HINT}")
    src = f"kubernetes_validate/kubernetes-json-schema/v{version}-local-strict/"
    dest = out / f"v{version}-standalone-strict"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        definitions = json.loads(z.read(src + "_definitions.json"))["$defs"]
        for kind in kinds:
            schema = json.loads(z.read(src + f"{kind}.json"))
            needed, todo = {}, set()
            _refs(schema, todo)
            while todo:
                name = todo.pop()
                if name not in needed:
                    needed[name] = definitions[name]
                    _refs(needed[name], todo)
            schema.pop("$id", None)
            schema["$defs"] = needed
            (dest / f"{kind}.json").write_text(json.dumps(_local(schema)))
    return out


def schema_name(doc: dict) -> str:
    """kubeconform's ``{{ .ResourceKind }}{{ .KindSuffix }}`` of a document."""
    group, _, version = doc["apiVersion"].rpartition("/")
    return "-".join([doc["kind"].lower()] + ([group.split(".")[0]] if group else []) + [version])


@pytest.mark.parametrize("k8s_version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(k8s_version, tmp_path):
    exe = kubeconform()
    files = manifest_files()
    docs = all_documents(include_variants=True)
    schemas = standalone_schemas(tmp_path, k8s_version, {schema_name(d) for d in docs})
    location = (f"{schemas}/{{{{ .NormalizedKubernetesVersion }}}}-standalone"
                f"{{{{ .StrictSuffix }}}}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json")
    proc = subprocess.run(
        [exe, "-strict", "-summary", "-output", "json", "-kubernetes-version", k8s_version,
         "-schema-location", location, *map(str, files)],
        capture_output=True, text=True, timeout=60)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, json.dumps(report["resources"], indent=1) + proc.stderr
    summary = report["summary"]
    assert summary["valid"] == len(docs), summary
    assert (summary["invalid"], summary["errors"], summary["skipped"]) == (0, 0, 0), summary


def test_kubeconform_catches_a_wrong_field(tmp_path):
    """The validation is real: strict mode refuses a misspelt field and a wrong type."""
    exe = kubeconform()
    worker = find("Deployment", "trainguard-worker")
    typo = copy.deepcopy(worker)
    pod_spec(typo)["hostPid"] = True
    wrong_type = copy.deepcopy(worker)
    wrong_type["spec"]["replicas"] = "two"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all([typo, wrong_type]))
    version = KUBERNETES_VERSIONS[-1]
    schemas = standalone_schemas(tmp_path / "schemas", version, {schema_name(worker)})
    proc = subprocess.run(
        [exe, "-strict", "-summary", "-output", "json", "-kubernetes-version", version,
         "-schema-location", f"{schemas}/{{{{ .NormalizedKubernetesVersion }}}}-standalone"
         "{{ .StrictSuffix }}/{{ .ResourceKind }}{{ .KindSuffix }}.json", str(bad)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["summary"]["invalid"] == 2


# ----------------------------------------------------------- manifests against the code
def test_every_container_command_line_parses():
    for workload in workloads():
        for container in pod_spec(workload)["containers"]:
            args = parse_trainguard(container["args"])
            assert args.command in ("worker", "actions", "agent", "topics"), container["args"]


def test_metrics_ports_are_the_services_ports():
    from trainguard.service_metrics import METRICS_PORTS

    for service in ("worker", "actions", "agent"):
        workload = next(d for d in all_documents()
                        if d["kind"] in ("Deployment", "DaemonSet")
                        and d["metadata"]["name"] == f"trainguard-{service}")
        [container] = pod_spec(workload)["containers"]
        [port] = container["ports"]
        args = parse_trainguard(container["args"])
        # the worker's --metrics-port keeps the destination of its old --web-port
        flag_port = args.web_port if service == "worker" else args.metrics_port
        assert port["containerPort"] == int(flag_port) == METRICS_PORTS[service], service
        svc = find("Service", f"trainguard-{service}-metrics")
        assert svc["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
        [svc_port] = svc["spec"]["ports"]
        assert (svc_port["port"], svc_port["targetPort"]) == (METRICS_PORTS[service], "metrics")
        bind = args.web_bind if service == "worker" else args.metrics_bind
        assert bind == "0.0.0.0", f"{service}: Prometheus scrapes the pod's address"


def test_the_configmap_is_a_valid_configuration(tmp_path):
    from trainguard.configsections import check_tree, load

    config = find("ConfigMap", "trainguard-config")
    path = tmp_path / "config.toml"
    path.write_text(config["data"]["config.toml"])
    tree = load(str(path), {})
    check_tree(tree, {})
    driver = tree.value("driver")
    assert driver["type"] == "kubernetes"
    assert tree.value("policy.dry_run") is True, "first deployment: dry run (docs/DRIVERS.md)"
    role = find("Role", "trainguard-actions-restart")
    assert role["metadata"]["namespace"] == driver["namespace"]
    for workload in workloads():
        spec = pod_spec(workload)
        [container] = spec["containers"]
        assert env_of(container)["TRAINGUARD_CONFIG"]["value"] == "/etc/trainguard/config.toml"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["config"]["mountPath"] == "/etc/trainguard"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["config"]["configMap"]["name"] == "trainguard-config"


def driver_calls() -> set[str]:
    """The CoreV1Api methods actions/drivers/kubernetes.py calls (through ``_call``)."""
    source = (REPO / "actions" / "drivers" / "kubernetes.py").read_text()
    return set(re.findall(r'self\._call\(calls, "\w+", "(\w+)"', source))


#: CoreV1Api method -> (API group, resource, verb, namespaced)
RBAC_OF_CALL = {
    "patch_node": ("", "nodes", "patch", False),
    "list_namespaced_pod": ("", "pods", "list", True),
    "delete_namespaced_pod": ("", "pods", "delete", True),
}


def test_rbac_is_exactly_what_the_kubernetes_driver_calls():
    calls = driver_calls()
    assert calls == set(RBAC_OF_CALL), (
        f"the Kubernetes driver calls {sorted(calls)}: update RBAC_OF_CALL and "
        "deploy/kubernetes/actions-rbac.yaml")
    granted = set()
    for kind, binding_kind, name in (("ClusterRole", "ClusterRoleBinding",
                                      "trainguard-actions-cordon"),
                                     ("Role", "RoleBinding", "trainguard-actions-restart")):
        role = find(kind, name)
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no names, no *
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb, kind == "Role"))
        binding = find(binding_kind, name)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": kind,
                                      "name": name}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "trainguard-actions",
                                        "namespace": "trainguard"}]
    assert granted == set(RBAC_OF_CALL.values())
    assert not any("*" in str(r) for d in all_documents() if d["kind"] in ("Role", "ClusterRole")
                   for r in d["rules"])
    actions = pod_spec(find("Deployment", "trainguard-actions"))
    assert actions["serviceAccountName"] == "trainguard-actions"
    # nothing else gets an API token
    for workload in workloads():
        if workload["metadata"]["name"] != "trainguard-actions":
            assert pod_spec(workload)["automountServiceAccountToken"] is False


AGENT_CAPABILITIES = {"SYS_PTRACE", "KILL"}


def test_the_agent_gets_exactly_what_stack_capture_needs():
    agent = find("DaemonSet", "trainguard-agent")
    spec = pod_spec(agent)
    assert spec["hostPID"] is True, "py-spy must see the training processes"
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    assert spec["automountServiceAccountToken"] is False
    [container] = spec["containers"]
    sc = container["securityContext"]
    assert sc == {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
                  "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"},
                  "capabilities": {"drop": ["ALL"], "add": sorted(AGENT_CAPABILITIES,
                                                                  reverse=True)}}
    host_paths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {"registry": {"path": "/run/trainguard/run",
                                       "type": "DirectoryOrCreate"}}
    args = parse_trainguard(container["args"])
    assert args.runtime_dir == "/run/trainguard/run"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["registry"] == args.runtime_dir
    env = env_of(container)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_kmsg_variant_adds_only_what_reading_dev_kmsg_needs():
    default = find("DaemonSet", "trainguard-agent")
    variant = find("DaemonSet", "trainguard-agent",
                   documents(K8S / "variants" / "agent-kmsg.yaml"))
    [container] = pod_spec(variant)["containers"]
    assert container["securityContext"] == {"runAsUser": 0, "runAsNonRoot": False,
                                            "privileged": True, "readOnlyRootFilesystem": True}
    kmsg_mount = [m for m in container["volumeMounts"] if m["name"] == "kmsg"]
    assert kmsg_mount == [{"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True}]
    kmsg_volume = [v for v in pod_spec(variant)["volumes"] if v["name"] == "kmsg"]
    assert kmsg_volume == [{"name": "kmsg", "hostPath": {"path": "/dev/kmsg",
                                                         "type": "CharDevice"}}]
    # everything else is agent.yaml's
    stripped = copy.deepcopy(variant)
    [c] = pod_spec(stripped)["containers"]
    c["securityContext"] = pod_spec(default)["containers"][0]["securityContext"]
    c["volumeMounts"].remove(kmsg_mount[0])
    pod_spec(stripped)["volumes"].remove(kmsg_volume[0])
    assert stripped == default


def test_worker_and_actions_run_restricted_and_only_trusted_services_hold_the_key():
    holders = set()
    for workload in workloads():
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        [container] = spec["containers"]
        if "TRAINGUARD_SIGNING_KEY" in env_of(container):
            ref = env_of(container)["TRAINGUARD_SIGNING_KEY"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "trainguard-signing-key", "key": "key"}
            holders.add(name)
        if name == "trainguard-agent":
            continue
        # the Pod Security "restricted" profile
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["readOnlyRootFilesystem"] is True
        assert not any("hostPath" in v for v in spec["volumes"])
        assert not (spec.get("hostPID") or spec.get("hostNetwork") or spec.get("hostIPC"))
    # docs/SECURITY.md, trust model: the action service and the agents, never the worker
    assert holders == {"trainguard-actions", "trainguard-agent"}
    worker = find("Deployment", "trainguard-worker")
    assert worker["spec"]["strategy"] == {"type": "Recreate"}, "docs/WORKER.md, Upgrading"
    assert parse_trainguard(pod_spec(worker)["containers"][0]["args"]).id


# ------------------------------------------------------------------------ Containerfile
def containerfile_stages() -> list[dict]:
    text = (DEPLOY / "Containerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    stages: list[dict] = []
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
            stages.append({"from": m.group(1), "name": m.group(2), "lines": []})
        elif stages:
            stages[-1]["lines"].append((instruction, rest.strip()))
        else:
            assert instruction == "ARG", f"{instruction} before the first FROM"
    return stages


def test_containerfile_builds_the_services_as_a_non_root_trainguard():
    stages = containerfile_stages()
    assert [s["name"] for s in stages] == ["build", "runtime"]
    for stage in stages:
        assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim(-\w+)?", stage["from"])
    build, runtime = stages
    runs = " ".join(rest for ins, rest in build["lines"] if ins == "RUN")
    assert re.search(r'pip install "\.\[server(,[a-z0-9]+)*\]"', runs), \
        "the services need trainguard's server extra"
    assert "k8s" in runs, "the action service's Kubernetes driver"
    final = dict()
    for instruction, rest in runtime["lines"]:
        final.setdefault(instruction, []).append(rest)
    [user] = final["USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root user (runAsNonRoot checks it)"
    assert json.loads(final["ENTRYPOINT"][-1]) == ["trainguard"]
    assert all("--from=build" in c for c in final["COPY"]), "the runtime stage copies the venv"
    # the image's uid is the one the manifests run the services as
    for workload in workloads():
        if workload["metadata"]["name"] != "trainguard-agent":
            assert pod_spec(workload)["securityContext"]["runAsUser"] == int(uid)
    # `trainguard` is the package's console script, and what COPY needs is in the context
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "trainguard" in scripts
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)
    for needed in ("pyproject.toml", "README.md", "LICENSE", "trainguard", "deploy"):
        assert needed not in ignored and (REPO / needed).exists(), needed


# ------------------------------------------------------------------------------ systemd
UNITS = ("trainguard-worker.service", "trainguard-actions.service", "trainguard-agent.service")
VENV_TRAINGUARD = "/opt/trainguard/.venv/bin/trainguard"


def unit_settings(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_systemd_units_verify(tmp_path):
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd; "
                    "scripts/test.sh installs it as root)")
    trainguard = Path(sys.executable).with_name("trainguard")
    assert trainguard.exists()
    for name in UNITS:  # the same units, with this checkout's trainguard in ExecStart
        text = (SYSTEMD / name).read_text()
        assert VENV_TRAINGUARD in text
        (tmp_path / name).write_text(text.replace(VENV_TRAINGUARD, str(trainguard)))
    proc = subprocess.run([exe, "verify", *(str(tmp_path / n) for n in UNITS)],
                          capture_output=True, text=True, timeout=60)
    # unknown keys and bad values are only warnings: any output fails the test
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), \
        proc.stdout + proc.stderr


def test_systemd_units_command_lines_and_privileges():
    for name in UNITS:
        settings = unit_settings(name)
        [exec_start] = settings["ExecStart"]
        argv = shlex.split(exec_start)
        assert argv[0] == VENV_TRAINGUARD
        parse_trainguard([a for a in argv[1:] if not a.startswith("$")])
        assert settings["User"] == ["trainguard"] and settings["NoNewPrivileges"] == ["yes"]
        holds_key = "/etc/trainguard/signing.env" in settings["EnvironmentFile"]
        assert holds_key == (name != "trainguard-worker.service"), name
    agent = unit_settings("trainguard-agent.service")
    caps = {"CAP_SYS_PTRACE", "CAP_SYSLOG", "CAP_KILL"}
    assert set(agent["AmbientCapabilities"][0].split()) == caps
    assert set(agent["CapabilityBoundingSet"][0].split()) == caps
    # each of these would break ptrace, /dev/kmsg or NVML (the unit says why)
    for breaking in ("PrivateDevices", "ProtectKernelLogs", "ProtectProc", "ProcSubset",
                     "PrivateUsers", "PrivateTmp", "SystemCallFilter", "DevicePolicy"):
        assert breaking not in agent, breaking
    assert agent["ProtectHome"] == ["read-only"]
    assert "--runtime-dir /run/trainguard/run" in agent["ExecStart"][0]
    assert agent["ReadWritePaths"] == ["/run/trainguard/run"]
    tmpfiles = (SYSTEMD / "trainguard.conf").read_text()
    assert re.search(r"^d /run/trainguard/run 1777 ", tmpfiles, re.M)
    for name in ("trainguard-worker.service", "trainguard-actions.service"):
        settings = unit_settings(name)
        assert settings["CapabilityBoundingSet"] == [""]
        assert settings["PrivateDevices"] == ["yes"] and settings["ProtectKernelLogs"] == ["yes"]


# -------------------------------------------------------------------------------- Slurm
SLURM_SCRIPTS = ("prolog.sh", "epilog.sh", "task-prolog.sh")


def test_slurm_scripts_parse_and_pass_shellcheck():
    for name in SLURM_SCRIPTS:
        subprocess.run(["bash", "-n", str(SLURM / name)], check=True, timeout=30)
        assert os.access(SLURM / name, os.X_OK), f"{name} must be executable"
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (Debian package shellcheck; scripts/test.sh "
                    "installs it as root); bash -n passed")
    proc = subprocess.run([exe, *(str(SLURM / n) for n in SLURM_SCRIPTS),
                           str(REPO / "scripts" / "deploy_tools.sh")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def fake_node(tmp_path):
    """A node for the prolog and epilog: a systemctl that records its calls, and their
    state folders in tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "systemctl.log"
    systemctl = bin_dir / "systemctl"
    systemctl.write_text("#!/bin/bash\n"
                         f'echo "$*" >> {shlex.quote(str(calls))}\n'
                         '[ "$1" = is-enabled ] && exit "${FAKE_ENABLED:-1}"\n'
                         "exit 0\n")
    systemctl.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "TRAINGUARD_SLURM_DIR": str(tmp_path / "slurm"),
           "TRAINGUARD_REGISTRY_DIR": str(tmp_path / "run"), "SLURMD_NODENAME": "gpu-node-07"}

    def run(script: str, job: str, **extra) -> list[str]:
        proc = subprocess.run([str(SLURM / script)], env={**env, "SLURM_JOB_ID": job, **extra},
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return calls.read_text().splitlines() if calls.exists() else []

    return run, tmp_path


def test_prolog_starts_the_agent_and_the_last_epilog_stops_it(fake_node):
    run, tmp = fake_node
    unit = "trainguard-agent.service"
    assert run("prolog.sh", "101") == [f"start {unit}"]
    assert (tmp / "slurm" / "agent.env").read_text() == "NODE_NAME=gpu-node-07\n"
    assert oct((tmp / "run").stat().st_mode & 0o7777) == "0o1777"
    run("prolog.sh", "102")                       # a second job shares the node
    assert run("epilog.sh", "101")[-1] == f"start {unit}", "job 102 still runs: no stop"
    assert run("epilog.sh", "102")[-2:] == [f"is-enabled --quiet {unit}", f"stop {unit}"]
    # an enabled unit (the site runs the agent always) is left running
    run("prolog.sh", "103")
    assert run("epilog.sh", "103", FAKE_ENABLED="0")[-2:] == [f"start {unit}",
                                                             f"is-enabled --quiet {unit}"]


def test_prolog_never_fails_the_job(fake_node):
    run, tmp = fake_node
    assert run("prolog.sh", "") == []             # no job id: nothing done, exit 0
    assert run("prolog.sh", "1; reboot") == []
    assert run("prolog.sh", "7", SLURMD_NODENAME="bad name$(x)") == []
    assert run("epilog.sh", "8") == []            # an epilog without its prolog


def test_task_prolog_points_ranks_at_the_agents_registry():
    out = subprocess.run([str(SLURM / "task-prolog.sh")], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "TRAINGUARD_HOME"},
                         timeout=30).stdout
    assert out == "export TRAINGUARD_HOME=/run/trainguard\n"
    from trainguard.collectors.registry import default_runtime_dir

    volumes = {v["name"]: v for v in pod_spec(find("DaemonSet", "trainguard-agent"))["volumes"]}
    assert str(default_runtime_dir({"TRAINGUARD_HOME": "/run/trainguard"})) == \
        "/run/trainguard/run" == volumes["registry"]["hostPath"]["path"]
