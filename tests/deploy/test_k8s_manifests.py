"""deploy/k8s: every kustomization renders (kubectl kustomize, offline) and validates strictly, the built-in
kinds against the Kubernetes schemas (kubernetes-validate), the custom resources against the CRD schemas in
deploy/k8s/crds/. Then what the issue asks of the manifests, checked on the rendered output: restricted pods,
probes, grace periods that cover preStop + --shutdown-timeout, mutual TLS, no start deadlock, DNS discovery
of the engine replicas, one image naming scheme with compose and `make images`, the GPU overlay's scheduling."""

from __future__ import annotations

import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.k8s_render import K8S, ROOT, kustomizations, render

KUBERNETES_VERSION = "1.32.0"            # the oldest release the manifests promise (sleep-free preStop, PDB v1)
FOLDERS = kustomizations()
REGISTRY_EXAMPLE = "examples/registry"          # renames the images: test_k8s_namespace_and_registry.py
IMAGES = {"steploop/gateway", "steploop/scheduler", "steploop/worker-cpu", "steploop/worker-cuda", "steploop/model"}


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema, from the vendored CRDs."""
    schemas = {}
    for path in sorted((K8S / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


CRDS = crd_schemas()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {str(folder.relative_to(K8S)): render(folder) for folder in FOLDERS}


def test_the_expected_kustomizations_exist():
    names = {str(f.relative_to(K8S)) for f in FOLDERS}
    assert {"base", "overlays/cpu", "overlays/gpu", "examples/inference-extension"} <= names, names


@pytest.mark.parametrize("folder", [str(f.relative_to(K8S)) for f in FOLDERS])
def test_renders_and_validates_strictly(rendered, folder):
    for doc in rendered[folder]:
        key = (doc["apiVersion"], doc["kind"])
        name = f"{folder}: {doc['kind']}/{doc['metadata']['name']}"
        if key in CRDS:
            try:
                jsonschema.validate(doc, CRDS[key])
            except jsonschema.ValidationError as err:
                raise AssertionError(f"{name}: {err.message} at {list(err.absolute_path)}") from None
            continue
        try:   # a custom kind without a vendored CRD fails here too (no schema for it)
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.utils.SchemaNotFoundError:
            raise AssertionError(f"{name}: neither a Kubernetes {KUBERNETES_VERSION} kind nor a CRD in "
                                 f"deploy/k8s/crds/") from None
        except kubernetes_validate.ValidationError as err:
            raise AssertionError(f"{name}: {err.message} at {list(err.path)}") from None


def docs_of(rendered, kind: str) -> list[tuple[str, dict]]:
    return [(folder, d) for folder, docs in rendered.items() for d in docs if d["kind"] == kind]


def pod_specs(rendered) -> list[tuple[str, str, dict]]:
    """Every pod template: Deployments', StatefulSets', and a LeaderWorkerSet's leader ("engine") and ranks
    ("engine-rank", a worker container alone that dials its leader's scheduler)."""
    specs = []
    for folder, docs in rendered.items():
        for d in docs:
            if d["kind"] in ("Deployment", "StatefulSet"):
                specs.append((folder, d["metadata"]["name"], d["spec"]["template"]["spec"]))
            elif d["kind"] == "LeaderWorkerSet":
                group = d["spec"]["leaderWorkerTemplate"]
                specs.append((folder, d["metadata"]["name"], group["leaderTemplate"]["spec"]))
                specs.append((folder, d["metadata"]["name"] + "-rank", group["workerTemplate"]["spec"]))
    return specs


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "<from secret>") for e in container.get("env", [])}


def test_every_pod_is_restricted_and_sized(rendered):
    for folder, name, spec in pod_specs(rendered):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] and pod["seccompProfile"]["type"] == "RuntimeDefault", (folder, name)
        assert spec["automountServiceAccountToken"] is False, (folder, name)
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            where = (folder, name, c["name"])
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            for side in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][side]), where


def test_every_service_container_has_probes_that_restart_a_hung_one(rendered):
    for folder, name, spec in pod_specs(rendered):
        for c in spec["containers"]:
            assert "livenessProbe" in c, (folder, name, c["name"])
            assert "readinessProbe" in c or "startupProbe" in c, (folder, name, c["name"])
        by_name = {c["name"]: c for c in spec["containers"]}
        if "worker" in by_name and "scheduler" in by_name:   # model loading is a startup probe's job
            worker = by_name["worker"]
            startup = worker["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
            assert "127.0.0.1:50051" in worker["livenessProbe"]["exec"]["command"]
            # the scheduler's liveness must not fail just because its worker is away (any health answer counts)
            assert "--alive" in by_name["scheduler"]["livenessProbe"]["exec"]["command"]


def prestop_seconds(container: dict) -> int:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return int(command[1]) if command[:1] == ["sleep"] else 0


def test_grace_periods_cover_prestop_and_shutdown_timeout(rendered):
    for folder, name, spec in pod_specs(rendered):
        grace = spec["terminationGracePeriodSeconds"]
        for c in spec["containers"]:
            drain = float(env_of(c).get("STEPLOOP_SHUTDOWN_TIMEOUT", 0))
            assert prestop_seconds(c) + drain < grace, (folder, name, c["name"], grace)
        by_name = {c["name"]: c for c in spec["containers"]}
        if "worker" in by_name and "scheduler" in by_name:   # the worker stays up while its scheduler drains
            sched = by_name["scheduler"]
            assert prestop_seconds(by_name["worker"]) >= prestop_seconds(sched) + float(
                env_of(sched)["STEPLOOP_SHUTDOWN_TIMEOUT"])


def test_internal_links_are_mutual_tls(rendered):
    for folder, name, spec in pod_specs(rendered):
        for c in spec["containers"]:
            env = env_of(c)
            assert {"STEPLOOP_TLS_CA", "STEPLOOP_TLS_CERT", "STEPLOOP_TLS_KEY"} <= set(env), (folder, c["name"])
            mounted = {m["mountPath"] for m in c["volumeMounts"]}
            assert {env["STEPLOOP_TLS_CA"], env["STEPLOOP_TLS_CERT"], env["STEPLOOP_TLS_KEY"]} <= mounted
            if c["name"] in ("gateway", "openai"):
                assert env["STEPLOOP_API_KEY"] == "<from secret>"


def test_the_worker_reaches_its_scheduler_inside_the_pod(rendered):
    """No start deadlock: the worker dials the scheduler container on loopback, never a Service that routes
    only to ready pods (the scheduler is ready only once its worker attached)."""
    for folder, name, spec in pod_specs(rendered):
        by_name = {c["name"]: c for c in spec["containers"]}
        if "worker" in by_name and not name.endswith("-rank"):
            assert "scheduler" in by_name, (folder, name)
            assert env_of(by_name["worker"])["STEPLOOP_SCHEDULER_ADDRESS"] == "127.0.0.1:50051"


def test_gateways_discover_engine_replicas_through_the_headless_service(rendered):
    for docs in rendered.values():
        services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
        for lws in (d for d in docs if d["kind"] == "LeaderWorkerSet"):   # the leaders serve; the ranks do not
            sets[lws["metadata"]["name"]] = {"spec": {"serviceName": "engine-headless", "selector": {
                "matchLabels": lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]}}}
        gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway")
        env = env_of(gateway["spec"]["template"]["spec"]["containers"][0])
        host, _, port = env["STEPLOOP_SCHEDULER_ADDRESS"].rpartition(":")
        headless = services[host]
        assert headless["spec"]["clusterIP"] == "None" and not headless["spec"]["publishNotReadyAddresses"]
        assert int(port) in {p["port"] for p in headless["spec"]["ports"]}
        assert float(env["STEPLOOP_SCHEDULER_DISCOVERY_INTERVAL"]) > 0
        assert sets["engine"]["spec"]["serviceName"] == host
        assert headless["spec"]["selector"] == sets["engine"]["spec"]["selector"]["matchLabels"]


def image_repos(rendered) -> set[str]:
    return {c["image"].rsplit(":", 1)[0] for folder, _, spec in pod_specs(rendered) if folder != REGISTRY_EXAMPLE
            for c in spec["containers"] + spec.get("initContainers", [])}


def test_one_image_naming_scheme_with_compose_and_make(rendered):
    assert image_repos(rendered) <= IMAGES, image_repos(rendered)
    for _, _, spec in pod_specs(rendered):
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["image"].endswith(":0.1.0"), c["image"]      # every image tagged (the project version)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    compose_repos = {s["image"].replace("${STEPLOOP_REGISTRY:-steploop}", "steploop").split(":")[0]
                     for s in compose["services"].values()}
    assert compose_repos == IMAGES, compose_repos
    makefile = (ROOT / "Makefile").read_text()
    for image in IMAGES:
        assert f"$(STEPLOOP_REGISTRY)/{image.split('/')[1]}:$(STEPLOOP_TAG)" in makefile, image


def test_the_overlays_pick_their_worker(rendered):
    def worker(folder):
        spec = next(s for f, n, s in pod_specs(rendered) if f == folder and n == "engine")
        return spec, next(c for c in spec["containers"] if c["name"] == "worker")

    spec, gpu = worker("overlays/gpu")
    assert gpu["image"].startswith("steploop/worker-cuda:") and gpu["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["runtimeClassName"] == "nvidia" and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert env_of(gpu)["STEPLOOP_DEVICE"] == "cuda"
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    spec, cpu = worker("overlays/cpu")
    assert cpu["image"].startswith("steploop/worker-cpu:") and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert "runtimeClassName" not in spec


def test_only_gateways_reach_the_scheduler_port(rendered):
    for docs in rendered.values():
        policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
        deny = policies["default-deny"]["spec"]
        assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
        for rule in policies["engine"]["spec"]["ingress"]:
            if any(p["port"] == 50051 for p in rule["ports"]):
                assert rule["from"] == [{"podSelector": {"matchLabels": {
                    "app.kubernetes.io/name": "steploop", "app.kubernetes.io/component": "gateway"}}}]


def test_scaling_targets_the_engine_on_the_queue(rendered):
    scaled = docs_of(rendered, "ScaledObject") + docs_of(rendered, "HorizontalPodAutoscaler")
    assert {f for f, _ in scaled} >= {"overlays/cpu", "overlays/gpu"}
    for _, d in scaled:
        assert d["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "engine"}
        text = yaml.safe_dump(d)
        assert "num_requests_waiting" in text
    for folder in ("overlays/cpu", "overlays/gpu"):
        kinds = [d["kind"] for d in rendered[folder]]
        assert kinds.count("PodDisruptionBudget") == 2 and kinds.count("PodMonitor") == 2, folder


def test_every_crd_schema_is_used():
    used = {(d["apiVersion"], d["kind"]) for f in FOLDERS for d in render(f)}
    assert set(CRDS) <= used, set(CRDS) - used


def test_prometheus_counts_each_counter_once(rendered):
    """The gateway re-exports its schedulers' vllm:* series; its PodMonitor keeps only its own."""
    for _, monitor in docs_of(rendered, "PodMonitor"):
        if monitor["metadata"]["name"] == "gateway":
            (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
            (keep,) = endpoint["metricRelabelings"]
            assert keep["action"] == "keep" and "vllm" not in keep["regex"]




def test_the_tp_overlay_runs_a_leader_worker_set_group(rendered):
    """overlays/tp: the engine is a LeaderWorkerSet of -tp pods; every rank's worker gets the group size, its rank
    from the pod's worker-index label and its pod IP as --tp-host; ranks 1.. dial the leader's scheduler; the pod
    templates validate as Kubernetes PodTemplateSpecs; only the group's pods reach each other."""
    (lws,) = [d for d in rendered["overlays/tp"] if d["kind"] == "LeaderWorkerSet"]
    assert not [d for d in rendered["overlays/tp"] if d["kind"] == "StatefulSet"]
    group = lws["spec"]["leaderWorkerTemplate"]
    size = group["size"]
    for which in ("leaderTemplate", "workerTemplate"):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": which},
                                      "template": group[which]}, KUBERNETES_VERSION, strict=True)
        worker = next(c for c in group[which]["spec"]["containers"] if c["name"] == "worker")
        env = {e["name"]: e for e in worker["env"]}
        assert env["STEPLOOP_TENSOR_PARALLEL_SIZE"]["value"] == str(size)
        assert "worker-index" in env["STEPLOOP_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert env["STEPLOOP_TP_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    leader = {c["name"]: c for c in group["leaderTemplate"]["spec"]["containers"]}
    assert env_of(leader["scheduler"])["STEPLOOP_TENSOR_PARALLEL_SIZE"] == str(size)
    (rank,) = group["workerTemplate"]["spec"]["containers"]
    assert env_of(rank)["STEPLOOP_SCHEDULER_ADDRESS"] == "$(LWS_LEADER_ADDRESS):50051"
    policy = next(d for d in rendered["overlays/tp"] if d["metadata"]["name"] == "engine-tp-group")
    peers = {"podSelector": {"matchLabels": {"leaderworkerset.sigs.k8s.io/name": "engine"}}}
    assert policy["spec"]["ingress"] == [{"from": [peers]}] and policy["spec"]["egress"][0] == {"to": [peers]}


def test_dns_egress_reaches_node_local_dns_cache_too(rendered):
    """A rule that lets pods reach kube-dns also lets them reach NodeLocal DNSCache (169.254.20.10 on each node,
    host-networked, so no podSelector matches it): with it installed the pods' resolv.conf points there."""
    rules = [rule for docs in rendered.values() for d in docs if d["kind"] == "NetworkPolicy"
             for rule in d["spec"].get("egress", []) if any(p["port"] == 53 for p in rule.get("ports", []))]
    assert rules
    for rule in rules:
        assert {"ipBlock": {"cidr": "169.254.20.10/32"}} in rule["to"], rule


def test_a_node_drain_keeps_an_engine_serving(rendered):
    """Two engine replicas at least (StatefulSet, HPA/KEDA floor), spread over nodes, one down at a time."""
    for folder in ("overlays/cpu", "overlays/gpu"):
        docs = {(d["kind"], d["metadata"]["name"]): d for d in rendered[folder]}
        engine = docs[("StatefulSet", "engine")]["spec"]
        assert engine["replicas"] >= 2
        spread = engine["template"]["spec"]["topologySpreadConstraints"]
        assert spread[0]["topologyKey"] == "kubernetes.io/hostname"
        assert docs[("PodDisruptionBudget", "engine")]["spec"]["maxUnavailable"] == 1
        scaler = docs.get(("HorizontalPodAutoscaler", "engine")) or docs[("ScaledObject", "engine")]
        assert scaler["spec"].get("minReplicas", scaler["spec"].get("minReplicaCount")) >= 2, folder


def test_the_gateway_stays_ready_without_an_engine(rendered):
    """Readiness on /version (not /health): with no engine serving, clients get the gateway's 503, not a Service
    without endpoints (refused connections)."""
    for folder, name, spec in pod_specs(rendered):
        if name == "gateway":
            (gateway,) = spec["containers"]
            assert gateway["readinessProbe"]["httpGet"]["path"] == "/version", folder


def lws_of(rendered, folder: str) -> dict:
    (lws,) = [d for d in rendered[folder] if d["kind"] == "LeaderWorkerSet"]
    assert not [d for d in rendered[folder] if d["kind"] == "StatefulSet"], folder
    return lws["spec"]["leaderWorkerTemplate"]


def group_containers(group: dict) -> list[tuple[str, dict]]:
    return [(which, c) for which in ("leaderTemplate", "workerTemplate") for c in group[which]["spec"]["containers"]]


@pytest.mark.parametrize("folder, tp, pp, expert", [("overlays/tp", 3, 1, False), ("overlays/tp-pp", 3, 2, False),
                                                    ("overlays/ep", 2, 1, True)])
def test_parallel_groups_agree_on_their_shape(rendered, folder, tp, pp, expert):
    """A group is -tp x -pp pods; the scheduler and every rank are told the same sizes (the scheduler refuses a
    rank that differs), and expert parallelism is on for every rank or none."""
    group = lws_of(rendered, folder)
    assert group["size"] == tp * pp, folder
    for which, c in group_containers(group):
        env = env_of(c)
        assert env["STEPLOOP_TENSOR_PARALLEL_SIZE"] == str(tp), (folder, which, c["name"])
        assert env.get("STEPLOOP_PIPELINE_PARALLEL_SIZE", "1") == str(pp), (folder, which, c["name"])
        if c["name"] == "worker":
            assert env.get("STEPLOOP_ENABLE_EXPERT_PARALLEL", "false") == str(expert).lower(), (folder, which)


def test_the_pd_overlay_pairs_a_prefill_pod_with_each_scheduler(rendered):
    """overlays/pd: each group is the scheduler + a decode worker (loopback, with a host KV tier) and one prefill
    pod dialling its own leader; the decode worker's receiver is on its pod IP at a named port that only the
    group's pods may reach; the pod templates validate as Kubernetes PodTemplateSpecs."""
    group = lws_of(rendered, "overlays/pd")
    assert group["size"] == 2
    for which in ("leaderTemplate", "workerTemplate"):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": which},
                                      "template": group[which]}, KUBERNETES_VERSION, strict=True)
    leader = {c["name"]: c for c in group["leaderTemplate"]["spec"]["containers"]}
    decode = {e["name"]: e for e in leader["worker"]["env"]}
    assert decode["STEPLOOP_KV_ROLE"]["value"] == "decode" and decode["STEPLOOP_SCHEDULER_ADDRESS"]["value"] == \
        "127.0.0.1:50051"
    assert float(decode["STEPLOOP_KV_OFFLOADING_SIZE"]["value"]) > 0
    assert decode["STEPLOOP_KV_TRANSFER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = int(decode["STEPLOOP_KV_TRANSFER_PORT"]["value"])
    assert {"name": "kv-transfer", "containerPort": port} in leader["worker"]["ports"]
    assert "STEPLOOP_DISAGG_MIN_PROMPT_TOKENS" in env_of(leader["scheduler"])
    (prefill,) = group["workerTemplate"]["spec"]["containers"]
    assert env_of(prefill)["STEPLOOP_KV_ROLE"] == "prefill"
    assert env_of(prefill)["STEPLOOP_SCHEDULER_ADDRESS"] == "$(LWS_LEADER_ADDRESS):50051"
    assert group["workerTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] != "engine"  # not served
    for _, c in group_containers(group):
        assert not {"STEPLOOP_TENSOR_PARALLEL_SIZE", "STEPLOOP_RANK"} & set(env_of(c)), c["name"]
    policy = next(d for d in rendered["overlays/pd"] if d["metadata"]["name"] == "engine-pd-group")
    peers = [{"podSelector": {"matchLabels": {"leaderworkerset.sigs.k8s.io/name": "engine"}}}]
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["from"] == peers and {"protocol": "TCP", "port": port} in ingress["ports"]
    assert policy["spec"]["egress"][0]["to"] == peers


def test_the_kv_pull_example_lets_engine_replicas_pull_from_each_other(rendered):
    """examples/kv-pull: each engine pod's scheduler publishes KV events and checks the other replicas' certificate
    against a name make-certs.sh puts in it (the gateway hands out pod IPs); its worker sends and receives
    (--kv-role both, a host tier, the receiver on the pod IP at a named port); the gateways hint pulls; engine pods
    reach each other on the scheduler and transfer ports and on nothing else."""
    docs = rendered["examples/kv-pull"]
    (engine,) = [d for d in docs if d["kind"] == "StatefulSet"]
    containers = {c["name"]: c for c in engine["spec"]["template"]["spec"]["containers"]}
    scheduler = env_of(containers["scheduler"])
    assert json.loads(scheduler["STEPLOOP_KV_EVENTS_CONFIG"])["enable_kv_cache_events"] is True
    name = re.escape(scheduler["STEPLOOP_KV_PULL_TLS_SERVER_NAME"])
    assert re.search(rf'DNS:{name}[,"]', (ROOT / "deploy" / "make-certs.sh").read_text())
    worker = {e["name"]: e for e in containers["worker"]["env"]}
    assert worker["STEPLOOP_KV_ROLE"]["value"] == "both" and float(worker["STEPLOOP_KV_OFFLOADING_SIZE"]["value"]) > 0
    assert worker["STEPLOOP_KV_TRANSFER_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = int(worker["STEPLOOP_KV_TRANSFER_PORT"]["value"])
    assert {"name": "kv-transfer", "containerPort": port} in containers["worker"]["ports"]
    (gateway,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway"]
    assert env_of(gateway["spec"]["template"]["spec"]["containers"][0])["STEPLOOP_ENABLE_KV_PULL"] == "true"
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "engine-kv-pull")
    engines = [{"podSelector": {"matchLabels": engine["spec"]["selector"]["matchLabels"]}}]
    ports = [{"protocol": "TCP", "port": 50051}, {"protocol": "TCP", "port": port}]
    assert policy["spec"]["ingress"] == [{"from": engines, "ports": ports}]
    assert policy["spec"]["egress"] == [{"to": engines, "ports": ports}]


# STEPLOOP_* variables that are not flags: the images' healthcheck's server name (deploy/docker/healthcheck.py)
# and the cache folder (README "Quick start")
IMAGE_VARIABLES = {"STEPLOOP_TLS_SERVER_NAME", "STEPLOOP_CACHE_DIR"}


def test_every_variable_names_a_flag(rendered):
    """Every STEPLOOP_* variable a scheduler, worker or gateway container is given is a flag its command reads
    (STEPLOOP_ + the long flag's name): a misspelt one would be ignored without a word."""
    from scripts.readme_flags import options, parsers
    from services.common.envs import env_name
    known = {command: {env_name(flag) for a in options(p) for flag in a.option_strings if flag.startswith("--")}
             for command, p in parsers().items()}
    for folder, name, spec in pod_specs(rendered):
        for c in spec["containers"]:
            command = {"scheduler": "scheduler", "worker": "worker", "gateway": "gateway"}.get(c["name"])
            for variable in env_of(c) if command else ():
                if variable.startswith("STEPLOOP_") and variable not in IMAGE_VARIABLES:
                    assert variable in known[command], (folder, name, c["name"], variable)
