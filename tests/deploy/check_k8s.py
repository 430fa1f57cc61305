#!/usr/bin/env python3
"""Renders every overlay under deploy/k8s/overlays with `kubectl kustomize`
(offline) and checks the objects against each other and against the
binaries:

- every Service selects the pods of some Deployment, and each of its
  target ports is a port those pods' containers expose;
- every flag in every container's args and in the flagfile they name is a
  flag the binary defines (asked of the binary: --helpfull);
- the flagfile an arg names is a key of the ConfigMap mounted there, and
  every ConfigMap and Secret a pod mounts is rendered too;
- every probe's port is one of its container's ports;
- every gRPC probe asks a health service the servers answer;
- terminationGracePeriodSeconds is above the container's --drain_grace_s
  and --drain_min_s, and a worker's --drain_min_s above the routers'
  --resolve_interval_s;
- every HorizontalPodAutoscaler scales a rendered Deployment, on a metric
  the router exposes, with a scale-down stabilization window;
- every metric an alert's expression names is one the servers define;
- a container runs --backend=cuda exactly when it has an nvidia.com/gpu
  limit (no CUDA worker without a GPU, no GPU left to the CPU backend);
- UCX_TLS names its transports: tcp (the KV listener's connection setup),
  no shared memory (pods on one node share a boot id, not /dev/shm), and
  RDMA transports only with an rdma/ device resource.

Each rendered overlay is also validated against the Kubernetes OpenAPI
schemas offline, unknown fields refused (tests/k8s_schema/validate.mjs,
npm packages installed by deploy/test.sh).

    check_k8s.py REPO_DIR BUILD_DIR                      all overlays
    check_k8s.py REPO_DIR BUILD_DIR --schema FILE --expect-failures
                                   (a manifest the API would refuse)
    check_k8s.py REPO_DIR BUILD_DIR --rendered FILE --expect-failures
                                   (a broken fixture: each check must fail)
Exit 77 (skipped) without kubectl.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

BINARIES = {"pdserve/router": "router/pdserve-router", "pdserve/prefill": "prefill_worker/pdserve-prefill-worker",
            "pdserve/decode": "decode_worker/pdserve-decode-worker"}
_flags_cache = {}


def binary_flags(build, image):
    path = os.path.join(build, BINARIES[image.split(":")[0]])
    if path not in _flags_cache:
        out = subprocess.run([path, "--helpfull"], capture_output=True, text=True).stdout
        _flags_cache[path] = set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", out, re.M))
    return _flags_cache[path]


# UCX transport names (UCX_TLS) by what they need of a pod.
UCX_SHARED_MEMORY = {"sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"}
UCX_RDMA = {"ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5", "dc",
            "dc_x", "dc_mlx5"}


def check_gpu_and_ucx(where, c, args):
    """The backend against the GPUs the container has, and its UCX_TLS."""
    errors = []
    limits = c.get("resources", {}).get("limits", {})
    gpus = int(limits.get("nvidia.com/gpu", 0))
    backend = ([a.split("=", 1)[1] for a in args if a.startswith("--backend=")] or ["cpu"])[-1]
    if backend == "cuda" and gpus < 1:
        errors.append(f"{where}: --backend=cuda without a nvidia.com/gpu limit")
    if gpus and backend != "cuda":
        errors.append(f"{where}: has {gpus} nvidia.com/gpu but runs --backend={backend}")
    tls = next((e.get("value", "") for e in c.get("env", []) if e["name"] == "UCX_TLS"), None)
    if tls is not None:
        names = set(tls.split(","))
        if tls.startswith("^") or "all" in names:
            errors.append(f"{where}: UCX_TLS={tls}: list the transports (no shared memory between pods)")
        elif "tcp" not in names:
            errors.append(f"{where}: UCX_TLS={tls}: no tcp, which the KV listener's connection setup needs")
        if names & UCX_SHARED_MEMORY:
            errors.append(f"{where}: UCX_TLS={tls}: shared memory between pods")
        if names & UCX_RDMA and not any(k.startswith("rdma/") for k in limits):
            errors.append(f"{where}: UCX_TLS={tls}: RDMA without an rdma/ device resource")
    return errors


def flag_names(args):
    names = []
    for a in args:
        m = re.match(r"--([A-Za-z0-9_]+)(?:=|$)", a)
        if m:
            names.append((m.group(1), a))
    return names


def check(objects, build, external_secrets=()):
    errors = []
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], []).append(o)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    deployments = by_kind.get("Deployment", [])
    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector", {})
        pods = [d for d in deployments
                if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
        if not pods:
            errors.append(f"Service {svc['metadata']['name']}: selects no Deployment's pods ({sel})")
            continue
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            for d in pods:
                ports = [cp for c in d["spec"]["template"]["spec"]["containers"] for cp in c.get("ports", [])]
                if not any(cp.get("name") == target or cp["containerPort"] == target for cp in ports):
                    errors.append(f"Service {svc['metadata']['name']}: targetPort {target} is not a port of "
                                  f"Deployment {d['metadata']['name']}")
    configmaps = {o["metadata"]["name"]: o for o in by_kind.get("ConfigMap", [])}
    drain_mins, resolve_intervals = [], []
    for d in deployments:
        dn = d["metadata"]["name"]
        spec = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v and ("ConfigMap", v["configMap"]["name"]) not in names:
                errors.append(f"Deployment {dn}: volume {v['name']}: no ConfigMap {v['configMap']['name']}")
            if "secret" in v and ("Secret", v["secret"]["secretName"]) not in names and \
                    not v["secret"].get("optional") and v["secret"]["secretName"] not in external_secrets:
                errors.append(f"Deployment {dn}: volume {v['name']}: no Secret {v['secret']['secretName']}")
        grace = spec.get("terminationGracePeriodSeconds", 30)
        for c in spec["containers"]:
            image = c.get("image", "")
            args = list(c.get("args", []))
            # The flagfile's lines, from the ConfigMap mounted at its directory.
            for a in list(args):
                m = re.match(r"--flagfile=(.+)", a)
                if not m:
                    continue
                directory, key = os.path.split(m.group(1))
                mount = next((vm for vm in c.get("volumeMounts", []) if vm["mountPath"] == directory), None)
                cm = volumes.get(mount["name"], {}).get("configMap", {}).get("name") if mount else None
                if cm is None or cm not in configmaps or key not in configmaps[cm].get("data", {}):
                    errors.append(f"Deployment {dn}: {a}: no ConfigMap key {key} mounted at {directory}")
                    continue
                args += [l.strip() for l in configmaps[cm]["data"][key].splitlines() if l.strip()]
            defined = binary_flags(build, c["image"])
            for name, a in flag_names(args):
                # absl's --noFLAG sets a boolean false.
                if name not in defined and not (name.startswith("no") and name[2:] in defined):
                    errors.append(f"Deployment {dn}: container {c['name']}: {a}: the binary has no --{name}")
            errors += check_gpu_and_ucx(f"Deployment {dn}: container {c['name']}", c, args)
            ports = c.get("ports", [])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if p is None:
                    errors.append(f"Deployment {dn}: container {c['name']}: no {probe}")
                    continue
                action = next((p[k] for k in ("grpc", "httpGet", "tcpSocket") if k in p), {})
                port = action.get("port")
                if not any(cp.get("name") == port or cp["containerPort"] == port for cp in ports):
                    errors.append(f"Deployment {dn}: {probe} port {port} is not a port of container {c['name']}")
                # The gRPC health services every server answers (base/grpc_server.h).
                if "grpc" in p and p["grpc"].get("service", "") not in ("", "liveness"):
                    errors.append(f"Deployment {dn}: {probe} asks the health service {p['grpc']['service']!r}, "
                                  "which no server answers")
            for flag in ("--drain_grace_s=", "--drain_min_s="):
                drain = [float(a.split("=", 1)[1]) for a in args if a.startswith(flag)]
                if drain and grace <= drain[-1]:
                    errors.append(f"Deployment {dn}: terminationGracePeriodSeconds {grace} is not above "
                                  f"{flag}{drain[-1]:g}")
            def last(flag, default):
                values = [float(a.split("=", 1)[1]) for a in args if a.startswith(flag)]
                return values[-1] if values else default
            if "pdserve/router" in image:
                resolve_intervals.append(last("--resolve_interval_s=", 5.0))
            elif "pdserve/prefill" in image or "pdserve/decode" in image:
                drain_mins.append((f"Deployment {dn}: container {c['name']}", last("--drain_min_s=", 0.0)))
    # A draining worker stays up until every router re-resolved the worker
    # Services, so none sends to a vanished address.
    for where, drain_min in drain_mins:
        # Routers rendered elsewhere: the default interval.
        for resolve in resolve_intervals or [5.0]:
            if drain_min <= resolve:
                errors.append(f"{where}: --drain_min_s={drain_min:g} stays up less than the router's "
                              f"--resolve_interval_s={resolve:g}")
    router_source = open(os.path.join(os.path.dirname(__file__), "../../router/router_service.cc")).read()
    for h in by_kind.get("HorizontalPodAutoscaler", []):
        hn = h["metadata"]["name"]
        ref = h["spec"]["scaleTargetRef"]
        if ref["kind"] != "Deployment" or not any(d["metadata"]["name"] == ref["name"] for d in deployments):
            errors.append(f"HorizontalPodAutoscaler {hn}: scales {ref['kind']} {ref['name']}, which is not rendered")
        for m in h["spec"].get("metrics", []):
            name = m.get("external", {}).get("metric", {}).get("name")
            if name and f'"{name}"' not in router_source:
                errors.append(f"HorizontalPodAutoscaler {hn}: the router exposes no metric {name}")
        if h["spec"].get("behavior", {}).get("scaleDown", {}).get("stabilizationWindowSeconds", 0) < 60:
            errors.append(f"HorizontalPodAutoscaler {hn}: no scale-down stabilization window")
    sources = ""
    root = os.path.join(os.path.dirname(__file__), "../..")
    for d in ("router", "base", "kv", "model", "text", "engine", "runtime", "prefill_worker", "decode_worker", "kv_transfer"):
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            sources += "".join(open(os.path.join(dirpath, f)).read() for f in files if f.endswith(".cc"))
    for rule in by_kind.get("PrometheusRule", []):
        for g in rule["spec"]["groups"]:
            for r in g["rules"]:
                for metric in set(re.findall(r"\b(pdserve_[a-z_]+)", r["expr"])):
                    base = re.sub(r"_(bucket|count|sum)$", "", metric)
                    if f'"{base}"' not in sources:
                        errors.append(f"alert {r.get('alert')}: no server defines the metric {base}")
    return errors


def schema_check(repo, path):
    """(ok, output) of validate.mjs on a rendered file."""
    d = os.path.join(repo, "tests/k8s_schema")
    if not os.path.isdir(os.path.join(d, "node_modules/kubernetes-models")):
        return False, "the schema validator's npm packages are not installed (deploy/test.sh installs them)"
    r = subprocess.run(["node", os.path.join(d, "validate.mjs"), path], capture_output=True, text=True)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def main():
    repo, build = sys.argv[1], sys.argv[2]
    expect_failures = "--expect-failures" in sys.argv
    if "--schema" in sys.argv:
        ok, out = schema_check(repo, sys.argv[sys.argv.index("--schema") + 1])
        print(out)
        if expect_failures:
            return 0 if (not ok and "unknown field" in out and "must be integer" in out) else 1
        return 0 if ok else 1
    if "--rendered" in sys.argv:
        docs = [d for d in yaml.safe_load_all(open(sys.argv[sys.argv.index("--rendered") + 1])) if d]
        errors = check(docs, build)
        for e in errors:
            print("FAIL:", e)
        kinds = ["selects no", "targetPort", "the binary has no", "is not a port of container", "is not above",
                 "no ConfigMap key", "no Secret", "which is not rendered", "exposes no metric",
                 "no scale-down stabilization", "no server defines the metric", "which no server answers",
                 "without a nvidia.com/gpu limit", "nvidia.com/gpu but runs", "list the transports", "no tcp",
                 "shared memory between pods", "RDMA without an rdma/ device", "stays up less than the router's"]
        missed = [k for k in kinds if not any(k in e for e in errors)]
        if expect_failures:
            if missed:
                print("the broken manifest passed these checks:", missed)
            return 1 if missed else 0
        return 1 if errors else 0
    if shutil.which("kubectl") is None:
        print("SKIPPED: kubectl is not installed (it renders the kustomize overlays offline)")
        return 77
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(repo, "deploy/k8s"), os.path.join(tmp, "k8s"),
                        ignore=shutil.ignore_patterns("certs"))
        overlays = sorted(os.listdir(os.path.join(tmp, "k8s/overlays")))
        for overlay in overlays:
            d = os.path.join(tmp, "k8s/overlays", overlay)
            # Overlays that generate their Secrets from certificates get a
            # development set, as their README says to make.
            if "certs/" in open(os.path.join(d, "kustomization.yaml")).read():
                subprocess.run([os.path.join(repo, "deploy/make_certs.sh"), os.path.join(d, "certs")], check=True,
                               capture_output=True)
            r = subprocess.run(["kubectl", "kustomize", d], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"FAIL: overlay {overlay} does not render: {r.stderr.strip()}")
                failed = True
                continue
            rendered = os.path.join(tmp, f"{overlay}.yaml")
            with open(rendered, "w") as f:
                f.write(r.stdout)
            ok, out = schema_check(repo, rendered)
            if not ok:
                print(f"FAIL: overlay {overlay}: schema:\n{out}")
                failed = True
            docs = [x for x in yaml.safe_load_all(r.stdout) if x]
            # Secrets the operator creates, named in the overlay's
            # "# external secrets:" line.
            m = re.search(r"^# external secrets: (.*)$", open(os.path.join(d, "kustomization.yaml")).read(), re.M)
            errors = check(docs, build, m.group(1).split() if m else ())
            for e in errors:
                print(f"FAIL: overlay {overlay}: {e}")
            failed |= bool(errors)
            print(f"overlay {overlay}: {len(docs)} objects, {len(errors)} problems")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
