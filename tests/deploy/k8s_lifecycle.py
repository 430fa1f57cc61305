#!/usr/bin/env python3
"""The rendered cpu-demo manifests run as local processes, the way a
Kubernetes node would run them, under steady load:

- Each pod is a network namespace on a bridge the test creates (in a "node"
  namespace of its own), so every flow crosses a network as between nodes.
  Its container runs exactly as rendered: the image's ENTRYPOINT (read from
  deploy/images/Dockerfile, the binary the build made) with the rendered
  args ($(VAR) expanded from the container's env), the image's ENV and the
  container's env (the downward API's status.podIP and metadata.name), its
  volumes (ConfigMap keys, Secret keys, emptyDir, and the model the image
  layer holds) bind-mounted at their mountPaths, the pod's runAsUser and
  runAsGroup, no capabilities, no_new_privs, and a read-only root
  filesystem.
- The headless Services' names are served by a dnsmasq the test starts:
  NAME.NS.svc.cluster.local lists the pods that are ready and not
  terminating (the endpoints controller), with the search path and ndots a
  pod's resolv.conf has. The router's Service is not headless on a real
  cluster (a virtual IP); here its name lists the router pod.
- The rendered NetworkPolicies are applied as default-deny nftables rules
  in each selected pod's namespace (peers resolved to the pods' addresses
  and rewritten whenever pods come and go, as a CNI plugin does), so that a
  flow the policies do not list fails.
- The kubelet's part: the startup, readiness and liveness probes as
  rendered (gRPC health, asked with `pdctl probe` from the node), and a pod
  deletion as SIGTERM, terminationGracePeriodSeconds, then SIGKILL.
- The Deployment controller's part: replica counts edited in the rendered
  objects (what `kubectl scale` does) start or delete pods; a deleted pod
  of a Deployment is replaced.

Under a steady load of streamed completions over HTTPS (the OpenAI API,
checked against the router's certificate by its Service name), the test
scales decode 1 -> 3 -> 1 and prefill 1 -> 2 -> 1, deletes a decode pod,
and checks that no request fails, that greedy completions of one prompt are
identical whichever pods served them, and that every new pod takes work
(its committed KV handoffs, scraped from its metrics port by a pod labelled
as Prometheus). It then checks flows the policies do not list are dropped,
in both directions.

    k8s_lifecycle.py REPO_DIR BUILD_DIR [--keep]
Exit 77 (skipped) without root, kubectl, nft, dnsmasq or network namespaces.
"""
import base64
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import yaml

NODE_IP = "10.244.0.1"
SUBNET = "10.244.0"
CLUSTER_DOMAIN = "cluster.local"
LOAD_CONCURRENCY = 3
PROMPTS = ["In the beginning", "And God said", "The LORD is my shepherd", "Blessed are the meek",
           "For God so loved", "Let there be light"]


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def sh(cmd, check=True, **kw):
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd}: exit {r.returncode}: {r.stderr.strip()}")
    return r


# --- the images: deploy/images/Dockerfile read the way `docker build` would


def read_images(repo, build):
    """{image reference: {entrypoint, env, user, files: {image path: local path}}} for the
    images the Dockerfile's header builds (`docker build ... --target T -t IMAGE .`)."""
    text = open(os.path.join(repo, "deploy/images/Dockerfile")).read()
    targets = dict((m.group(2), m.group(1)) for m in re.finditer(r"--target\s+(\S+)\s+-t\s+(\S+)", text))
    stages, order, cur = {}, [], None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)", rest, re.I)
            cur = {"base": m.group(1), "lines": []}
            stages[m.group(2)] = cur
            order.append(m.group(2))
        else:
            cur["lines"].append((word, rest))
    # The builder stage's cmake -B /build is this build directory.
    builder_dir = re.search(r"-B\s+(\S+)", text).group(1)

    def resolve(stage):
        img = {"entrypoint": None, "env": {}, "user": None, "files": {}}
        s = stages[stage]
        if s["base"] in stages:
            img = resolve(s["base"])
            img = {k: (dict(v) if isinstance(v, dict) else v) for k, v in img.items()}
        for word, rest in s["lines"]:
            if word == "COPY":
                parts = rest.split()
                src, dst = parts[-2], parts[-1]
                if parts[0].startswith("--from="):
                    img["files"][dst] = os.path.join(build, os.path.relpath(src, builder_dir))
                else:
                    img["files"][dst] = os.path.join(repo, src)
            elif word == "ENV":
                k, _, v = rest.partition("=")
                img["env"][k.strip()] = v.strip()
            elif word == "USER":
                img["user"] = rest.strip()
            elif word == "ENTRYPOINT":
                img["entrypoint"] = json.loads(rest)
        return img

    return {image: resolve(target) for image, target in targets.items()}


# --- NetworkPolicy -> nftables


def selects(selector, labels):
    if set(selector) - {"matchLabels"}:
        raise ValueError(f"selector form not supported here: {selector}")
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def peer_ips(peer, policy_ns, pods):
    """The addresses of the pods a NetworkPolicy peer selects."""
    if set(peer) - {"podSelector", "namespaceSelector"}:
        raise ValueError(f"peer form not supported here: {peer}")
    ips = []
    for p in pods:
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": p.namespace}):
                continue
        elif p.namespace != policy_ns:
            continue
        if "podSelector" in peer and not selects(peer["podSelector"], p.labels):
            continue
        ips.append(p.ip)
    return sorted(ips)


def port_matches(ports):
    """nft port matches of a rule's ports: [] for "every port"."""
    out = []
    for p in ports or []:
        if not isinstance(p.get("port"), int):
            raise ValueError(f"named or missing port not supported here: {p}")
        proto = p.get("protocol", "TCP").lower()
        rng = f"{p['port']}-{p['endPort']}" if "endPort" in p else str(p["port"])
        out.append(f"{proto} dport {rng}")
    return out


def nft_ruleset(pod, policies, pods):
    """The pod's nftables ruleset: for each direction a policy of its
    namespace selects it in, default deny plus what the rules list."""
    chains = {}
    for pol in policies:
        if pol["metadata"].get("namespace") != pod.namespace or not selects(pol["spec"]["podSelector"], pod.labels):
            continue
        types = pol["spec"].get("policyTypes", ["Ingress"])
        for direction, hook, key, peer_key, addr in (("Ingress", "input", "ingress", "from", "saddr"),
                                                     ("Egress", "output", "egress", "to", "daddr")):
            if direction not in types:
                continue
            rules = chains.setdefault(hook, [])
            for rule in pol["spec"].get(key) or []:
                peers = rule.get(peer_key)
                addr_match = ""  # No peers: any address.
                if peers:
                    ips = sorted({ip for peer in peers for ip in peer_ips(peer, pod.namespace, pods)})
                    if not ips:
                        continue  # names no pod now: allows nothing
                    addr_match = f"ip {addr} {{ {', '.join(ips)} }} "
                for pm in port_matches(rule.get("ports")) or [""]:
                    rules.append(f"{addr_match}{pm} accept".strip())
    lines = ["table inet pdk {}", "delete table inet pdk", "table inet pdk {"]
    for hook, rules in chains.items():
        iface = "iifname" if hook == "input" else "oifname"
        lines += [f"  chain {hook} {{", f"    type filter hook {hook} priority 0; policy drop;",
                  f'    {iface} "lo" accept', "    ct state established,related accept"]
        lines += [f"    {r}" for r in rules]
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- pods


class Pod:
    counter = 0

    def __init__(self, node, name, namespace, labels, spec=None, owner=None):
        Pod.counter += 1
        self.n = Pod.counter
        self.node, self.name, self.namespace, self.labels, self.spec, self.owner = (node, name, namespace, labels,
                                                                                    spec, owner)
        self.ip = f"{SUBNET}.{9 + self.n}"
        self.netns = f"{node.prefix}-{self.n}"
        self.dir = os.path.join(node.dir, name)
        self.proc = None
        self.started_up = self.ready = self.terminating = False
        self.exit = None  # how it ended: "exited N" or "SIGKILL after grace"
        self.next_probe = 0.0
        self.startup_failures = self.liveness_failures = 0
        self.log_path = os.path.join(self.dir, "container.log")
        os.makedirs(self.dir, mode=0o755)
        node.add_netns(self)

    def exec_argv(self, argv, mounts=(), ro_root=False, uid=None, gid=None, env=None):
        """argv run in this pod's network namespace, with `mounts` (source,
        target) bind-mounted and this pod's resolv.conf."""
        script = ["set -e"]
        for src, dst, *ro in list(mounts) + [(self.node.resolv_conf, "/etc/resolv.conf")]:
            script.append(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}")
            if ro and ro[0]:
                script.append(f"mount -o remount,bind,ro {shlex.quote(dst)}")
        if ro_root:
            script.append("mount -o remount,bind,ro /")
        cmd = []
        if uid is not None:
            cmd += ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs",
                    "--bounding-set=-all", "--inh-caps=-all", "--"]
        if env is not None:
            cmd += ["env", "-i"] + [f"{k}={v}" for k, v in env.items()]
        script.append("exec " + " ".join(shlex.quote(a) for a in cmd + argv))
        return ["ip", "netns", "exec", self.netns, "sh", "-c", "\n".join(script)]

    def start_container(self):
        spec = self.spec
        if len(spec["containers"]) != 1:
            raise ValueError(f"{self.name}: one container per pod is what this emulation runs")
        c = spec["containers"][0]
        image = self.node.images[c["image"]]
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME": self.name}
        env.update(image["env"])
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
            else:
                field = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"status.podIP": self.ip, "metadata.name": self.name,
                                  "metadata.namespace": self.namespace}[field]
        if "command" in c:
            raise ValueError(f"{self.name}: container command overrides are not used by these manifests")
        argv = [expand(a, env) for a in image["entrypoint"] + c.get("args", [])]
        # The image's files: the binary (copied where the pod's user can
        # read it) and, for cpu-demo, the model layer.
        mounts = []
        for dst, src in image["files"].items():
            if dst == argv[0]:
                local = os.path.join(self.node.dir, "bin", os.path.basename(dst))
                if not os.path.exists(local):
                    os.makedirs(os.path.dirname(local), mode=0o755, exist_ok=True)
                    shutil.copy2(src, local)
                argv[0] = local
            elif os.path.isdir(src):
                mounts.append((src, self.node.mount_point(dst), True))
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for vm in c.get("volumeMounts", []):
            v = volumes[vm["name"]]
            d = os.path.join(self.dir, "volumes", vm["name"])
            os.makedirs(d)
            if "configMap" in v:
                data = self.node.object("ConfigMap", v["configMap"]["name"])["data"]
                files = {k: s.encode() for k, s in data.items()}
            elif "secret" in v:
                data = self.node.object("Secret", v["secret"]["secretName"])["data"]
                files = {k: base64.b64decode(s) for k, s in data.items()}
            elif "emptyDir" in v:
                files = {}
                os.chmod(d, 0o1777)
            else:
                raise ValueError(f"{self.name}: volume {vm['name']}: kind not emulated")
            if "emptyDir" not in v:
                os.chmod(d, 0o755)
            for k, b in files.items():  # the API's defaultMode, 0644
                with open(os.path.join(d, k), "wb") as f:
                    f.write(b)
                os.chmod(os.path.join(d, k), 0o644)
            # ConfigMap and Secret volumes are read-only, as the kubelet mounts them.
            mounts.append((d, self.node.mount_point(vm["mountPath"]), "emptyDir" not in v or vm.get("readOnly")))
        psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
        uid = csc.get("runAsUser", psc.get("runAsUser", image["user"]))
        gid = csc.get("runAsGroup", psc.get("runAsGroup", uid))
        if psc.get("runAsNonRoot") and int(uid) == 0:
            raise ValueError(f"{self.name}: runAsNonRoot with uid 0")
        if csc.get("capabilities", {}).get("drop") != ["ALL"] or csc.get("allowPrivilegeEscalation", True):
            raise ValueError(f"{self.name}: expected capabilities dropped and no privilege escalation")
        full = self.exec_argv(argv, mounts, ro_root=csc.get("readOnlyRootFilesystem", False), uid=uid, gid=gid,
                              env=env)
        with open(os.path.join(self.dir, "command.json"), "w") as f:
            json.dump({"argv": argv, "env": env, "mounts": mounts, "uid": uid, "gid": gid}, f, indent=1)
        self.proc = subprocess.Popen(full, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started_at = time.monotonic()

    def probe(self, kind):
        c = self.spec["containers"][0]
        p = c[kind]
        port = p["grpc"]["port"]
        return self.node.node_run([self.node.pdctl, "probe", f"--addr={self.ip}:{port}",
                                   f"--service={p['grpc'].get('service', '')}",
                                   f"--timeout={p.get('timeoutSeconds', 1)}"]).returncode == 0

    def log_tail(self, n=30):
        try:
            return "".join(open(self.log_path, errors="replace").readlines()[-n:])
        except OSError:
            return ""


def expand(s, env):
    """Kubernetes' $(VAR) expansion ($$ escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), s)


class Node:
    """The bridge, dnsmasq, the pods and the controllers' loop."""

    def __init__(self, repo, build, objects, workdir):
        self.repo, self.build, self.objects = repo, build, objects
        self.dir = workdir
        self.prefix = f"pdk{os.getpid()}"
        self.node_ns = f"{self.prefix}-node"
        self.pdctl = os.path.join(build, "tools/pdctl/pdctl")
        self.images = read_images(repo, build)
        self.pods = []  # every pod, and the non-pdserve ones (client, prometheus)
        self.lock = threading.RLock()
        self.events = []
        self.errors = []
        self.created_mount_points = []
        self.resolv_conf = os.path.join(workdir, "resolv.conf")
        namespace = next(o["metadata"]["name"] for o in objects if o["kind"] == "Namespace")
        with open(self.resolv_conf, "w") as f:
            f.write(f"nameserver {NODE_IP}\nsearch {namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} "
                    f"{CLUSTER_DOMAIN}\noptions ndots:5\n")
        os.chmod(self.resolv_conf, 0o644)
        self.hosts = os.path.join(workdir, "dns.hosts")
        open(self.hosts, "w").close()
        os.chmod(self.hosts, 0o644)
        self.dns_log = os.path.join(workdir, "dnsmasq.log")
        self.dns_reads = 0
        self.stop = threading.Event()

    # -- network
    def up(self):
        # The bridge's MAC is fixed: a bridge otherwise takes the lowest of
        # its ports' and changes it as pods come and go, and the pods'
        # cached neighbour entry for the node (their DNS server) would go
        # stale for seconds.
        sh(f"ip netns add {self.node_ns} && ip -n {self.node_ns} link set lo up && "
           f"ip -n {self.node_ns} link add br0 address 02:00:0a:f4:00:01 type bridge && "
           f"ip -n {self.node_ns} addr add {NODE_IP}/24 dev br0 && "
           f"ip -n {self.node_ns} link set br0 up")
        self.dnsmasq = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns, "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts",
             "--no-poll", "--bind-interfaces", f"--listen-address={NODE_IP}", f"--addn-hosts={self.hosts}",
             f"--local=/{CLUSTER_DOMAIN}/", "--local-ttl=0", "--cache-size=0", "--user=root", "--pid-file=",
             f"--log-facility={self.dns_log}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.wait_dns_read(1)

    def add_netns(self, pod):
        host_if = f"pk{os.getpid() % 100000}h{pod.n}"
        sh(f"ip netns add {pod.netns} && ip -n {pod.netns} link set lo up && "
           f"ip -n {self.node_ns} link add {host_if} type veth peer name eth0 netns {pod.netns} && "
           f"ip -n {self.node_ns} link set {host_if} master br0 up && "
           f"ip -n {pod.netns} addr add {pod.ip}/24 dev eth0 && ip -n {pod.netns} link set eth0 up")

    def mount_point(self, path):
        """`path` as a mount point: created (empty) when missing, removed at the end."""
        if not os.path.exists(path):
            missing = path
            while not os.path.exists(os.path.dirname(missing)):
                missing = os.path.dirname(missing)
            os.makedirs(path)
            self.created_mount_points.append(missing)
        return path

    def node_run(self, argv, timeout=10):
        try:
            return subprocess.run(["ip", "netns", "exec", self.node_ns] + argv, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(argv, 124, "", "timeout")

    # -- objects
    def object(self, kind, name):
        return next(o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name)

    def event(self, what):
        log(what)
        self.events.append((time.monotonic(), what))

    def pdserve_pods(self):
        return [p for p in self.pods if p.owner is not None]

    def add_plain_pod(self, name, namespace, labels):
        p = Pod(self, name, namespace, labels)
        with self.lock:
            self.pods.append(p)
            self.apply_policies()
        return p

    def apply_policies(self):
        policies = [o for o in self.objects if o["kind"] == "NetworkPolicy"]
        for p in self.pods:
            rules = nft_ruleset(p, policies, [q for q in self.pods if not (q.exit and q.owner)])
            path = os.path.join(p.dir, "nftables.conf")
            with open(path, "w") as f:
                f.write(rules)
            sh(["ip", "netns", "exec", p.netns, "nft", "-f", path])

    # -- the endpoints controller, as DNS
    def wait_dns_read(self, reads):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                seen = open(self.dns_log).read().count(f"read {self.hosts} - ")
            except OSError:
                seen = 0
            if seen >= reads:
                self.dns_reads = seen
                return
            time.sleep(0.02)
        raise RuntimeError("dnsmasq did not read its hosts file")

    def publish_endpoints(self):
        lines = []
        for svc in (o for o in self.objects if o["kind"] == "Service"):
            sel = svc["spec"].get("selector", {})
            fqdn = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.{CLUSTER_DOMAIN}"
            for p in self.pdserve_pods():
                if p.ready and not p.terminating and all(p.labels.get(k) == v for k, v in sel.items()):
                    lines.append(f"{p.ip} {fqdn}")
        text = "\n".join(sorted(lines)) + "\n"
        if text != open(self.hosts).read():
            with open(self.hosts + ".new", "w") as f:
                f.write(text)
            os.chmod(self.hosts + ".new", 0o644)
            os.rename(self.hosts + ".new", self.hosts)
            self.dnsmasq.send_signal(signal.SIGHUP)
            self.wait_dns_read(self.dns_reads + 1)
            self.event("endpoints: " + ", ".join(sorted(f"{ln.split()[1].split('.')[0]}={ln.split()[0]}"
                                                        for ln in lines)))

    # -- the Deployment controller and the kubelet
    def deployments(self):
        return [o for o in self.objects if o["kind"] == "Deployment"]

    def scale(self, name, replicas):
        """What `kubectl scale deployment/NAME --replicas=N` does: edit the object."""
        with self.lock:
            self.object("Deployment", name)["spec"]["replicas"] = replicas
            with open(os.path.join(self.dir, "rendered-now.yaml"), "w") as f:
                yaml.safe_dump_all(self.objects, f)
        self.event(f"scale {name} to {replicas}")

    def live(self, deployment):
        return [p for p in self.pdserve_pods() if p.owner == deployment and not p.terminating]

    def create_pod(self, d):
        tmpl = d["spec"]["template"]
        suffix = f"{Pod.counter + 1:03d}"
        p = Pod(self, f"{d['metadata']['name']}-{suffix}", d["metadata"]["namespace"], tmpl["metadata"]["labels"],
                tmpl["spec"], d["metadata"]["name"])
        self.pods.append(p)
        self.apply_policies()  # its address is in its peers' rules before it runs
        p.start_container()
        self.event(f"pod {p.name} ({p.ip}) started")
        return p

    def delete_pod(self, p, why="deleted"):
        """Terminating: out of the endpoints, SIGTERM, and SIGKILL after the grace period."""
        with self.lock:
            if p.terminating:
                return
            p.terminating = True
            p.grace = p.spec.get("terminationGracePeriodSeconds", 30)
            p.term_at = time.monotonic()
            self.publish_endpoints()
            if p.proc and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
            self.event(f"pod {p.name} {why}: SIGTERM, grace {p.grace} s")

    def reconcile(self):
        with self.lock:
            now = time.monotonic()
            for d in self.deployments():
                live = self.live(d["metadata"]["name"])
                want = d["spec"].get("replicas", 1)
                for _ in range(want - len(live)):
                    self.create_pod(d)
                if len(live) > want:
                    # Not-ready pods first, then the newest (the ReplicaSet's order).
                    for p in sorted(live, key=lambda p: (p.ready, -p.n))[:len(live) - want]:
                        self.delete_pod(p, "scaled down")
            for p in self.pdserve_pods():
                if p.exit:
                    continue
                code = p.proc.poll()
                if code is not None:
                    p.exit = f"exited {code}" if code >= 0 else f"killed by signal {-code}"
                    if p.terminating:
                        self.event(f"pod {p.name} ended {time.monotonic() - p.term_at:.1f} s after SIGTERM: {p.exit}")
                        self.apply_policies()
                    else:
                        self.errors.append(f"pod {p.name} {p.exit} while running:\n{p.log_tail()}")
                        p.terminating = True
                        self.publish_endpoints()
                    continue
                if p.terminating:
                    if now - p.term_at > p.grace:
                        p.proc.send_signal(signal.SIGKILL)
                        self.event(f"pod {p.name}: grace over, SIGKILL")
                    continue
                if now < p.next_probe:
                    continue
                c = p.spec["containers"][0]
                if not p.started_up:
                    if p.probe("startupProbe"):
                        p.started_up = True
                        self.event(f"pod {p.name} started up in {time.monotonic() - p.started_at:.1f} s")
                    else:
                        p.startup_failures += 1
                        if p.startup_failures >= c["startupProbe"].get("failureThreshold", 3):
                            self.errors.append(f"pod {p.name} never passed its startup probe:\n{p.log_tail()}")
                        p.next_probe = now + c["startupProbe"].get("periodSeconds", 10)
                        continue
                ready = p.probe("readinessProbe")
                if ready != p.ready:
                    p.ready = ready
                    self.event(f"pod {p.name} {'ready' if ready else 'not ready'}")
                    self.publish_endpoints()
                if not p.probe("livenessProbe"):
                    p.liveness_failures += 1
                    if p.liveness_failures >= c["livenessProbe"].get("failureThreshold", 3):
                        self.errors.append(f"pod {p.name} failed its liveness probe:\n{p.log_tail()}")
                else:
                    p.liveness_failures = 0
                p.next_probe = now + c["readinessProbe"].get("periodSeconds", 10)

    def run_controllers(self):
        while not self.stop.is_set():
            try:
                self.reconcile()
            except Exception as e:  # a controller's failure fails the test
                self.errors.append(f"controller: {e!r}")
                self.stop.set()
            time.sleep(0.25)

    def teardown(self):
        self.stop.set()
        for p in self.pods:
            if p.proc and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        if getattr(self, "dnsmasq", None):
            self.dnsmasq.kill()
            self.dnsmasq.wait()
        for p in self.pods:
            sh(f"ip netns del {p.netns}", check=False)
        sh(f"ip netns del {self.node_ns}", check=False)
        # The mount points made for the pods, while they hold no file.
        for d in reversed(self.created_mount_points):
            if not any(fs for _, _, fs in os.walk(d)):
                shutil.rmtree(d, ignore_errors=True)


# --- load: streamed completions over HTTPS from the client pod


def load_main(url, ca, out_path, stop_path, concurrency):
    """Runs in the client pod: `concurrency` loops of streamed completions
    until `stop_path` exists; one JSON line per request."""
    host, port = url.split("//")[1].split(":")
    ctx = ssl.create_default_context(cafile=ca)
    out = open(out_path, "a", buffering=1)
    lock = threading.Lock()

    def get_model():
        for _ in range(100):
            try:
                conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
                conn.request("GET", "/v1/models")
                r = conn.getresponse()
                if r.status == 200:
                    return json.loads(r.read())["data"][0]["id"]
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("no /v1/models")

    model = get_model()

    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        rec = {"t0": time.time(), "prompt": prompt, "ok": False}
        try:
            conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(
                {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}),
                {"Content-Type": "application/json"})
            r = conn.getresponse()
            rec["status"] = r.status
            if r.status != 200:
                rec["error"] = r.read().decode(errors="replace")[:300]
            else:
                text, done, finish = "", False, None
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        rec["error"] = ev["error"]
                        break
                    ch = ev["choices"][0]
                    text += ch.get("text", "")
                    finish = ch.get("finish_reason") or finish
                rec.update(text=text, finish=finish)
                rec["ok"] = done and "error" not in rec and finish is not None
                if not done and "error" not in rec:
                    rec["error"] = "the stream ended without [DONE]"
            conn.close()
        except Exception as e:
            rec["error"] = repr(e)
        rec["t1"] = time.time()
        with lock:
            out.write(json.dumps(rec) + "\n")

    # Ends by itself if the test never writes the stop file.
    give_up = time.time() + 900

    def loop(k):
        i = k
        while not os.path.exists(stop_path) and time.time() < give_up and os.getppid() != 1:
            one(i)
            i += concurrency

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def read_load(path):
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


# --- the test


def scrape(prom, pod, metric):
    """Sum of `metric` on the pod's metrics port, fetched from the Prometheus pod."""
    port = next(p["containerPort"] for p in pod.spec["containers"][0]["ports"] if p["name"] == "metrics")
    r = sh(prom.exec_argv(["curl", "-sf", "--max-time", "2", f"http://{pod.ip}:{port}/metrics"]), check=False)
    if r.returncode != 0:
        return None
    return sum(float(m.group(1)) for m in re.finditer(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", r.stdout, re.M))


def can_connect(pod, ip, port, timeout=1.0):
    code = (f"import socket,sys\ns=socket.socket()\ns.settimeout({timeout})\n"
            f"try:\n s.connect(('{ip}',{port}));sys.exit(0)\nexcept OSError:\n sys.exit(1)")
    return sh(pod.exec_argv([sys.executable, "-c", code]), check=False).returncode == 0


def wait_for(what, cond, timeout, node):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.errors:
            raise RuntimeError("; ".join(node.errors))
        if cond():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def render(repo, tmp):
    shutil.copytree(os.path.join(repo, "deploy/k8s"), os.path.join(tmp, "k8s"), ignore=shutil.ignore_patterns("certs"))
    overlay = os.path.join(tmp, "k8s/overlays/cpu-demo")
    sh([os.path.join(repo, "deploy/make_certs.sh"), os.path.join(overlay, "certs")])
    out = sh(["kubectl", "kustomize", overlay]).stdout
    with open(os.path.join(tmp, "rendered.yaml"), "w") as f:
        f.write(out)
    return [d for d in yaml.safe_load_all(out) if d], os.path.join(overlay, "certs/ca.pem")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        load_main(*sys.argv[2:6], int(sys.argv[6]))
        return 0
    repo, build = sys.argv[1], sys.argv[2]
    keep = "--keep" in sys.argv
    missing = [t for t in ("kubectl", "nft", "dnsmasq", "ip", "setpriv", "curl") if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        print(f"SKIPPED: needs {', '.join(missing)} (deploy/test.sh installs the tools; namespaces need root)")
        return 77
    probe_ns = f"pdk{os.getpid()}-probe"
    if sh(f"ip netns add {probe_ns} && ip netns exec {probe_ns} nft add table inet t", check=False).returncode:
        sh(f"ip netns del {probe_ns}", check=False)
        print("SKIPPED: cannot create network namespaces with nftables here")
        return 77
    sh(f"ip netns del {probe_ns}")
    # Leftovers of earlier runs whose process is gone.
    for ns in sh("ip netns list", check=False).stdout.split():
        m = re.match(r"pdk(\d+)-", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            sh(f"ip netns del {ns}", check=False)

    # Not under /tmp: each pod's /tmp is an emptyDir mounted over it.
    tmp = tempfile.mkdtemp(prefix="pdk-lifecycle-", dir="/var/tmp")
    os.chmod(tmp, 0o755)
    objects, ca = render(repo, tmp)
    node = Node(repo, build, objects, tmp)
    failed = []
    load = None
    try:
        node.up()
        ns = next(o["metadata"]["name"] for o in objects if o["kind"] == "Namespace")
        client = node.add_plain_pod("client", "default", {"app.kubernetes.io/name": "client"})
        prom = node.add_plain_pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
        controllers = threading.Thread(target=node.run_controllers, daemon=True)
        controllers.start()

        def ready(owner, n):
            return lambda: sum(1 for p in node.live(owner) if p.ready) >= n

        wait_for("the first pods to be ready", lambda: all(ready(d["metadata"]["name"], 1)()
                                                            for d in node.deployments()), 120, node)
        router_svc = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "pdserve-router")
        https = next(p["port"] for p in router_svc["spec"]["ports"] if p["name"] == "https")
        load_out, stop = os.path.join(tmp, "load.jsonl"), os.path.join(tmp, "load.stop")
        ca_copy = os.path.join(tmp, "ca.pem")
        shutil.copy(ca, ca_copy)
        load = subprocess.Popen(client.exec_argv([sys.executable, os.path.abspath(__file__), "--load",
                                                  f"https://pdserve-router:{https}", ca_copy, load_out, stop,
                                                  str(LOAD_CONCURRENCY)]),
                                stdout=open(os.path.join(tmp, "load.log"), "w"), stderr=subprocess.STDOUT)
        marks = {}

        def done_requests():
            return len(read_load(load_out)) if os.path.exists(load_out) else 0

        def mark(name):
            marks[name] = time.time()
            node.event(f"-- {name} ({done_requests()} requests so far)")

        def takes_work(pods):
            return lambda: all((scrape(prom, p, "pdserve_handoff_transfers_total") or 0) > 0 for p in pods)

        wait_for("the first requests", lambda: done_requests() >= 10 or load.poll() is not None, 60, node)
        if load.poll() is not None:
            raise RuntimeError("the load generator ended: " + open(os.path.join(tmp, "load.log")).read())
        mark("steady")

        first = {d: node.live(d)[0] for d in ("pdserve-prefill", "pdserve-decode")}
        node.scale("pdserve-decode", 3)
        wait_for("3 ready decode pods", ready("pdserve-decode", 3), 120, node)
        new = [p for p in node.live("pdserve-decode") if p is not first["pdserve-decode"]]
        wait_for("the new decode pods to take work", takes_work(new), 60, node)
        mark("decode at 3")

        node.scale("pdserve-prefill", 2)
        wait_for("2 ready prefill pods", ready("pdserve-prefill", 2), 120, node)
        new = [p for p in node.live("pdserve-prefill") if p is not first["pdserve-prefill"]]
        wait_for("the new prefill pod to take work", takes_work(new), 60, node)
        mark("prefill at 2")

        victim = first["pdserve-decode"]
        node.delete_pod(victim)
        wait_for("the deleted pod to end", lambda: victim.exit is not None, victim.grace + 10, node)
        wait_for("its replacement to be ready", ready("pdserve-decode", 3), 120, node)
        replacement = max(node.live("pdserve-decode"), key=lambda p: p.n)
        wait_for("the replacement to take work", takes_work([replacement]), 60, node)
        mark(f"decode pod deleted ({victim.exit})")

        node.scale("pdserve-decode", 1)
        node.scale("pdserve-prefill", 1)
        gone = [p for p in node.pdserve_pods() if p.terminating and not p.exit]
        wait_for("the scaled-down pods to end", lambda: all(p.exit for p in gone), 60, node)
        mark("decode at 1, prefill at 1")
        n_after = done_requests()
        wait_for("requests after scaling down", lambda: done_requests() >= n_after + 10, 60, node)
        mark("end of load")

        # Flows the policies do not list are dropped (and the listed ones pass).
        router = node.live("pdserve-router")[0]
        prefill = node.live("pdserve-prefill")[0]
        decode = node.live("pdserve-decode")[0]
        flows = [
            (client, router, 8000, True), (client, router, 7000, True), (client, router, 9090, False),
            (client, prefill, 7001, False), (client, decode, 7002, False), (client, decode, 7300, False),
            (prom, router, 9090, True), (prom, prefill, 9090, True), (prom, decode, 9090, True),
            (router, prefill, 7001, True), (router, decode, 7002, True), (router, decode, 7300, False),
            (prefill, decode, 7300, True), (prefill, router, 7000, False), (decode, router, 7000, False),
            (prom, prefill, 7001, False), (prefill, decode, 7500, False), (decode, prefill, 7001, False),
        ]
        for src, dst, port, allowed in flows:
            got = can_connect(src, dst.ip, port)
            line = f"{src.name} -> {dst.name}:{port}: {'open' if got else 'dropped'}"
            node.event("policy: " + line)
            if got != allowed:
                failed.append(f"network policy: {line}, expected {'open' if allowed else 'dropped'}")

        # The KV plane (the workers' default transport) listens on the
        # decode pod's KV port, the one the policies open to prefill pods.
        ports = {int(m.group(1)) for m in re.finditer(r":(\d+)\s", sh(decode.exec_argv(["ss", "-Htln"])).stdout)}
        node.event(f"listening in {decode.name}: {sorted(ports)}")
        if 7300 not in ports:
            failed.append(f"{decode.name}: no listener on the KV port 7300: {sorted(ports)}")

        open(stop, "w").close()
        load.wait(timeout=90)
        node.stop.set()
        controllers.join()
        failed += node.errors

        results = read_load(load_out)
        bad = [r for r in results if not r["ok"]]
        texts = {}
        for r in results:
            if r["ok"]:
                texts.setdefault(r["prompt"], set()).add(r["text"])
        differ = {p: t for p, t in texts.items() if len(t) > 1}
        phases = sorted(marks.items(), key=lambda kv: kv[1])
        for (name, t0), (_, t1) in zip(phases, phases[1:] + [("", float("inf"))]):
            n = sum(1 for r in results if t0 <= r["t0"] < t1)
            log(f"phase '{name}': {n} requests started")
            if n == 0 and t1 != float("inf"):
                failed.append(f"no request started during phase '{name}'")
        log(f"load: {len(results)} requests, {len(bad)} failed, {len(texts)} prompts, "
            f"{sum(1 for p in node.pdserve_pods())} pods in all")
        for r in bad[:10]:
            failed.append(f"request failed: {r}")
        for p, t in differ.items():
            failed.append(f"prompt {p!r}: {len(t)} different greedy completions: {sorted(t)}")
        # Every pod that was deleted or scaled away drained and exited on
        # its own within its grace period.
        for p in node.pdserve_pods():
            if p.terminating and p.exit != "exited 0":
                failed.append(f"pod {p.name} ended {p.exit} (expected to drain and exit 0 after SIGTERM)")
        if len(results) < 30:
            failed.append(f"only {len(results)} requests under load")
    except Exception as e:
        failed.append(f"{e}")
        for p in node.pdserve_pods():
            log(f"--- {p.name} ({p.ip}) log tail:\n{p.log_tail()}")
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.wait()
        node.teardown()
        if not keep and not failed:
            shutil.rmtree(tmp, ignore_errors=True)
    for f in failed:
        print("FAIL:", f)
    if failed:
        print(f"kept for inspection: {tmp}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
