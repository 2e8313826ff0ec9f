#!/usr/bin/env python3
"""Offline checks of the Kubernetes files in deploy/ (scripts/validate-deploy.sh
runs this in .venv-deploy with the pinned packages of
deploy/requirements-validate.txt; nothing here uses the network).

1. Every YAML document in deploy/ against the Kubernetes OpenAPI schemas
   that kubernetes-validate ships, strict (unknown fields fail), for each of
   K8S_VERSIONS; the ServiceMonitor (a CRD kind, unknown to it) against
   deploy/schemas/servicemonitor-monitoring-v1.json; duplicate YAML keys fail.
2. Every metric name in the Grafana dashboard's PromQL, the HPA and the
   prometheus-adapter rules is one the governor exposes: the names
   registered in crates/envelope-governor/src (metrics.rs) and
   crates/envelope-router/src (metrics.rs),
   with prometheus-client's suffixes (counters `_total`, histograms
   `_bucket`/`_sum`/`_count`) and the registry's prefix; every label they
   match or group by is one the governor's sources set or Prometheus adds.
3. Every flag and ENVELOPE_GOVERN_* variable given to `envelope govern` (the
   Deployment, the Dockerfile's CMD) is a long flag of GovernArgs in
   crates/envelope-governor/src/config.rs; `envelope sweep`'s flags are
   SweepArgs' (src/cli.rs); other ENVELOPE_* variables are named in the
   sources; the sweep's bench config and tenants.toml use only fields the
   Rust structs accept (they deny unknown fields); deploy/profile.json, once
   copied in, against profiles/schema/profile.schema.json.
4. References between the files: the Service reaches the governor's port
   only, vLLM binds loopback and is a sidecar, the governor's upstream is
   vLLM's port, its profile and tenants come from ConfigMap keys mounted
   without subPath, its probes use paths it serves to the kubelet, mounts
   and named ports exist, every container has CPU and memory requests and
   limits, the ServiceMonitor selects the Service's port, the HPA targets the
   Deployment with metrics an adapter rule serves, the Job's vLLM and
   nodeSelector are the Deployment's, the kustomization's files exist.

Every failure names the file and the field; exit status 1 on any.
Usage: deploy/validate.py [--deploy DIR]   (DIR: a copy of deploy/ to check)
"""
import argparse
import json
import os
import re
import sys
import time
import tomllib

import jsonschema
import kubernetes_validate.utils as kv
import yaml
from referencing import Registry, Resource

import validate_llm_d

from validate_sources import (BENCH_CONFIG, F, GOVERN_ARGS, PROFILE_SCHEMA, ROOT, SWEEP_ARGS,
                              TENANTS, allowed, check_expr, check_toml_fields, flag_value,
                              envelope_env_names, governor_get_paths, governor_labels,
                              governor_metrics, long_flags, read, rel)

# The oldest Kubernetes with sidecar containers on by default (1.29) and
# the one they are GA in (1.33).
K8S_VERSIONS = ("1.29.0", "1.33.0")
CONFIGMAP_MAX = 1 << 20  # the API server's limit on a ConfigMap
# Directories of deploy/ that hold a variant with its own kustomization.
VARIANTS = ("llm-d",)
# YAML files there that are not Kubernetes objects: the kustomizations, the
# picker's config and the values of its Helm chart (validate_llm_d.py).
NOT_MANIFESTS = {"kustomization.yaml", "epp-config.yaml", "router-values.yaml"}


# ---------------------------------------------------------------- YAML and JSON

class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping."""


def _mapping(loader, node, deep=False):
    seen = set()
    for k, _ in node.value:
        key = loader.construct_object(k, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", k.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(path):
    try:
        with open(path) as f:
            return [d for d in yaml.load_all(f, Loader=StrictLoader) if d is not None]
    except yaml.YAMLError as e:
        F.add(rel(path), "(yaml)", str(e).replace("\n", " "))
        return []


def check_dashboard(path, exposed, labels):
    file = rel(path)
    try:
        d = json.loads(read(path))
    except json.JSONDecodeError as e:
        F.add(file, "(json)", str(e))
        return 0
    for key in ("title", "uid", "panels", "templating"):
        if key not in d:
            F.add(file, key, "missing")
    variables = {v.get("name") for v in d.get("templating", {}).get("list", [])}
    count, ids = 0, set()

    def used_vars(s, where):
        for v in re.findall(r"\$\{?(\w+)", s):
            if not v.startswith("__") and v not in variables:
                F.add(file, where, f"uses ${v}, not a dashboard variable")

    for i, v in enumerate(d.get("templating", {}).get("list", [])):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q)
        where = f"templating.list[{i}]({v.get('name')}).query"
        check_expr(m.group(1) if m else q, exposed, file, where, labels=labels)
        used_vars(q, where)
        count += 1
    panels = list(d.get("panels", []))
    for p in d.get("panels", []):
        panels += p.get("panels", [])
    for p in panels:
        where = f"panels[id={p.get('id')}]({p.get('title')})"
        if p.get("id") in ids:
            F.add(file, where, "duplicate panel id")
        ids.add(p.get("id"))
        if p.get("type") == "row":
            continue
        if "gridPos" not in p:
            F.add(file, where + ".gridPos", "missing")
        used_vars(json.dumps(p.get("datasource", {})), where + ".datasource")
        if not p.get("targets"):
            F.add(file, where + ".targets", "a panel without a query")
        for t in p.get("targets", []):
            tw = f"{where}.targets[{t.get('refId')}].expr"
            if not t.get("expr"):
                F.add(file, tw, "missing")
                continue
            check_expr(t["expr"], exposed, file, tw, labels=labels)
            used_vars(t["expr"], tw)
            count += 1
    return count


# ---------------------------------------------------------------- Kubernetes schemas

def k8s_definitions(version):
    path = os.path.join(os.path.dirname(kv.__file__), "kubernetes-json-schema",
                        f"v{version}-local-strict", "_definitions.json")
    with open(path) as f:
        return json.load(f)


CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "schemas/servicemonitor-monitoring-v1.json"}
# Kinds whose schema is a CRD's openAPIV3Schema (deploy/schemas/SOURCES.md):
# the CRD as published, or its schema extracted.
CRD_OPENAPI = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "schemas/inferencepool-inference.networking.k8s.io-v1.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "schemas/httproute-gateway.networking.k8s.io-v1-experimental.json",
}


def closed(schema):
    """A CRD's structural schema with unknown fields refused (the API
    server prunes them silently; a typo should fail here instead)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def openapi_schema(path, api_version):
    """The served version's openAPIV3Schema of a CRD file, or an extracted
    schema as it is; closed, with `metadata` open (the API server's)."""
    text = read(path)
    if path.endswith(".json"):
        schema = json.loads(text)
    else:
        crd = yaml.safe_load(text)
        version = api_version.split("/")[-1]
        schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"]
                      if v["name"] == version and v.get("served"))
    schema = closed(schema)
    schema.get("properties", {})["metadata"] = {"type": "object"}
    return schema


def validate_object(obj, file, deploy_dir):
    where = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    openapi = CRD_OPENAPI.get((obj.get("apiVersion"), obj.get("kind")))
    if openapi:
        schema = openapi_schema(os.path.join(deploy_dir, openapi), obj["apiVersion"])
        for e in jsonschema.Draft202012Validator(schema).iter_errors(obj):
            path = ".".join(str(p) for p in e.absolute_path) or "(top)"
            F.add(file, f"{where} {path}", f"{e.message} ({openapi}, closed)")
        return
    for version in K8S_VERSIONS:
        try:
            if crd:
                schema = json.loads(read(os.path.join(deploy_dir, crd)))
                defs = k8s_definitions(version)
                registry = Registry().with_resource(defs["$id"], Resource.from_contents(defs))
                jsonschema.Draft202012Validator(schema, registry=registry).validate(obj)
            else:
                kv.validate(obj, version, strict=True)
        except kv.SchemaNotFoundError as e:
            F.add(file, where, e.message + " (and no schema in deploy/schemas/)")
            return
        except jsonschema.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path) or "(top)"
            F.add(file, f"{where} {path}", f"{e.message} (Kubernetes {version}, strict)")
            return


# ---------------------------------------------------------------- references

def pod_specs(obj):
    k = obj.get("kind")
    if k == "Pod":
        return obj.get("spec") or {}
    if k in ("Deployment", "Job", "StatefulSet", "DaemonSet", "ReplicaSet"):
        return ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return None


def all_containers(spec):
    return ([("initContainers", c) for c in spec.get("initContainers") or []]
            + [("containers", c) for c in spec.get("containers") or []])


def role(c):
    args = c.get("args") or []
    cmd = c.get("command") or []
    if args[:1] == ["govern"] or cmd[-1:] == ["govern"]:
        return "governor"
    if args[:1] == ["sweep"]:
        return "sweep"
    if cmd[:2] == ["vllm", "serve"] or str(c.get("image", "")).startswith("vllm/"):
        return "vllm"
    return None


def check_flags(args, known, file, where, command):
    for i, a in enumerate(args):
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            if flag not in known:
                F.add(file, f"{where}[{i}]", f"{flag} is not a flag of `envelope {command}`")


def mounted(spec, c, path):
    """(volume, mount) holding `path` in container c."""
    best = None
    for m in c.get("volumeMounts") or []:
        mp = m.get("mountPath", "").rstrip("/") + "/"
        if path.startswith(mp) and (best is None or len(mp) > len(best[1]["mountPath"])):
            vol = next((v for v in spec.get("volumes") or [] if v.get("name") == m.get("name")), None)
            best = (vol, m)
    return best


def configmap_names(vol):
    if not vol:
        return []
    if "configMap" in vol:
        return [vol["configMap"].get("name")]
    return [s["configMap"].get("name") for s in (vol.get("projected") or {}).get("sources") or []
            if "configMap" in s]


def labels_match(selector, labels):
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def check_pod(obj, file, spec, ctx):
    where = f"{obj['kind']}/{obj['metadata'].get('name')}"
    vols = {v.get("name") for v in spec.get("volumes") or []}
    for v in spec.get("volumes") or []:
        claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
        if claim and claim not in ctx["pvcs"]:
            F.add(file, f"{where} volumes.{v['name']}", f"claim {claim} is defined in no file of deploy/")
    for sect, c in all_containers(spec):
        cw = f"{where} {sect}.{c.get('name')}"
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in (res.get(kind) or {}):
                    F.add(file, f"{cw}.resources.{kind}.{r}", "missing")
        for e in c.get("env") or []:
            n = e.get("name", "")
            if n.startswith("ENVELOPE_") and n not in ctx["envs"]:
                F.add(file, f"{cw}.env.{n}", "read nowhere in src/ or crates/")
        for m in c.get("volumeMounts") or []:
            if m.get("name") not in vols:
                F.add(file, f"{cw}.volumeMounts.{m.get('name')}", "no such volume in the pod")
        ports = {p.get("name") for p in c.get("ports") or []}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
            if isinstance(port, str) and port not in ports:
                F.add(file, f"{cw}.{probe}.httpGet.port", f"no container port named {port}")
        r = role(c)
        if r == "vllm" and "nvidia.com/gpu" not in (res.get("limits") or {}):
            F.add(file, f"{cw}.resources.limits", "no nvidia.com/gpu for vLLM")
        if r == "vllm":
            host = flag_value(c.get("args") or [], "--host")
            if host not in ("127.0.0.1", "localhost"):
                F.add(file, f"{cw}.args --host", f"vLLM binds {host or '0.0.0.0 (default)'}: clients could reach it past the governor")
            if sect == "initContainers" and c.get("restartPolicy") != "Always":
                F.add(file, f"{cw}.restartPolicy", "vLLM as an init container must be a sidecar (Always), or the pod never starts")
            ctx["vllm"].append((file, where, c, spec.get("nodeSelector")))
        elif r == "governor":
            check_governor(file, cw, spec, c, ctx)
        elif r == "sweep":
            check_sweep(file, cw, spec, c, ctx)


def check_governor(file, cw, spec, c, ctx):
    args = c.get("args") or []
    check_flags(args, ctx["govern_flags"], file, f"{cw}.args", "govern")
    for e in c.get("env") or []:
        if e.get("name", "").startswith("ENVELOPE_GOVERN_") and e["name"] not in ctx["govern_envs"]:
            F.add(file, f"{cw}.env.{e['name']}", "not a variable of `envelope govern`")
    vllm = [x for _, x in all_containers(spec) if role(x) == "vllm"]
    up = flag_value(args, "--upstream") or ""
    m = re.fullmatch(r"http://(127\.0\.0\.1|localhost):(\d+)/?", up)
    if not m:
        F.add(file, f"{cw}.args --upstream", f"{up!r}: not vLLM on the pod's loopback")
    elif vllm and m.group(2) != (flag_value(vllm[0].get("args") or [], "--port") or "8000"):
        F.add(file, f"{cw}.args --upstream", f"port {m.group(2)} is not vLLM's --port")
    listen = flag_value(args, "--listen") or "127.0.0.1:9000"
    lport = listen.rsplit(":", 1)[-1]
    if listen.startswith("127.") or listen.startswith("localhost"):
        F.add(file, f"{cw}.args --listen", f"{listen}: loopback, unreachable by the Service")
    if lport not in {str(p.get("containerPort")) for p in c.get("ports") or []}:
        F.add(file, f"{cw}.ports", f"no containerPort {lport} (--listen {listen})")
    for flag in ("--profile", "--tenants"):
        path = flag_value(args, flag)
        if not path:
            continue
        vm = mounted(spec, c, path)
        if not vm:
            F.add(file, f"{cw}.args {flag}", f"{path} is on no mounted volume")
            continue
        vol, mnt = vm
        if mnt.get("subPath"):
            F.add(file, f"{cw}.volumeMounts.{mnt['name']}.subPath", "a subPath mount is never updated: no hot reload")
        names = configmap_names(vol)
        key = os.path.relpath(path, mnt["mountPath"])
        if not names:
            F.add(file, f"{cw}.args {flag}", f"{path} is not from a ConfigMap")
        ctx["wanted_keys"].append((file, f"{cw}.args {flag}", names, key))


def check_sweep(file, cw, spec, c, ctx):
    args = c.get("args") or []
    check_flags(args, ctx["sweep_flags"], file, f"{cw}.args", "sweep")
    cfg = flag_value(args, "--config")
    vm = mounted(spec, c, cfg or "")
    if not cfg or not vm:
        F.add(file, f"{cw}.args --config", f"{cfg} is on no mounted volume")
    else:
        names = configmap_names(vm[0])
        ctx["wanted_keys"].append((file, f"{cw}.args --config", names,
                                   os.path.relpath(cfg, vm[1]["mountPath"]), "bench"))
    out = flag_value(args, "--out")
    vm = mounted(spec, c, (out or "") + "/")
    if not out or not vm or "persistentVolumeClaim" not in (vm[0] or {}):
        F.add(file, f"{cw}.args --out", f"{out} is not on a PersistentVolumeClaim")
    if spec.get("restartPolicy") not in ("Never", "OnFailure"):
        F.add(file, f"{cw} restartPolicy", "a Job's pod restarts Never or OnFailure")


def check_dockerfile(path, ctx):
    file = rel(path)
    text = read(path)
    lines = re.sub(r"\\\n", " ", text).splitlines()
    try:
        ep = [json.loads(l.split(None, 1)[1]) for l in lines if l.startswith("ENTRYPOINT ")]
        cmd = [json.loads(l.split(None, 1)[1]) for l in lines if l.startswith("CMD ")]
    except json.JSONDecodeError:
        F.add(file, "ENTRYPOINT/CMD", "not in the JSON (exec) form")
        return
    if ep[-1:] != [["envelope"]]:
        F.add(file, "ENTRYPOINT", "expected [\"envelope\"]")
    # The build uses the project's compiler flags: .cargo/ is copied in
    # before cargo builds, and the ignore file does not leave it out.
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if os.path.exists(os.path.join(root, ".cargo", "config.toml")):
        copy = next((i for i, l in enumerate(lines) if re.match(r"COPY\s+\.cargo/?\s", l)), None)
        build = next((i for i, l in enumerate(lines) if l.startswith("RUN") and "cargo build" in l), None)
        if copy is None or build is None or copy > build:
            F.add(file, "COPY .cargo", "the build stage must copy .cargo/ (the project's rustflags) before `cargo build`")
        ignore = path + ".dockerignore"
        if os.path.exists(ignore) and any(l.strip().rstrip("/") in (".cargo", "**/.cargo") for l in read(ignore).splitlines()):
            F.add(rel(ignore), ".cargo", "leaves out .cargo/, the project's compiler flags")
    if not cmd:
        return
    args = cmd[-1]
    if args[:1] == ["govern"]:
        check_flags(args, ctx["govern_flags"], file, "CMD", "govern")
    elif args[:1] == ["sweep"]:
        check_flags(args, ctx["sweep_flags"], file, "CMD", "sweep")


def check_kustomization(path, deploy_dir, ctx, validated):
    file = rel(path)
    docs = load_yaml(path)
    if not docs:
        return {}
    k = docs[0]
    for key in k:
        if key not in ("apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions",
                       "namespace", "namePrefix", "labels", "images", "patches"):
            F.add(file, key, "not a field this validator knows in a Kustomization")
    if k.get("kind") != "Kustomization" or not str(k.get("apiVersion", "")).startswith("kustomize.config.k8s.io/"):
        F.add(file, "kind", "not a kustomize.config.k8s.io Kustomization")
    for i, r in enumerate(k.get("resources") or []):
        if os.path.join(deploy_dir, r) not in validated:
            F.add(file, f"resources[{i}]", f"{r}: no such manifest in deploy/")
    generated = {}
    for i, g in enumerate(k.get("configMapGenerator") or []):
        keys = generated.setdefault(g.get("name"), {})
        for j, f in enumerate(g.get("files") or []):
            key, _, src = f.partition("=")
            src = src or key
            keys[os.path.basename(key)] = os.path.join(deploy_dir, src)
            full = os.path.join(deploy_dir, src)
            if os.path.basename(src) == "profile.json":
                ctx["profile"] = full
                continue  # written by the sweep Job, copied in before applying
            if not os.path.exists(full):
                F.add(file, f"configMapGenerator[{i}].files[{j}]", f"{src}: no such file")
    if not (k.get("generatorOptions") or {}).get("disableNameSuffixHash"):
        F.add(file, "generatorOptions.disableNameSuffixHash", "must be true: a hashed name rolls the pods instead of reloading the files")
    return generated


def adapter_rules(objects, exposed, labels):
    """{custom metric name the adapter serves: governor series}."""
    served = {}
    for file, o in objects:
        if o.get("kind") != "ConfigMap" or "config.yaml" not in (o.get("data") or {}):
            continue
        where = f"ConfigMap/{o['metadata'].get('name')} data.config.yaml"
        try:
            cfg = yaml.load(o["data"]["config.yaml"], Loader=StrictLoader) or {}
        except yaml.YAMLError as e:
            F.add(file, where, str(e).replace("\n", " "))
            continue
        rules = cfg.get("rules") or []
        rules = rules.get("custom", []) if isinstance(rules, dict) else rules
        for i, r in enumerate(rules):
            rw = f"{where} rules[{i}]"
            series = check_expr(r.get("seriesQuery", ""), exposed, file, rw + ".seriesQuery", labels=labels)
            check_expr(r.get("metricsQuery", ""), exposed, file, rw + ".metricsQuery", need_one=False, labels=labels)
            name = r.get("name") or {}
            for s in series:
                if name.get("matches") and not re.search(name["matches"], s):
                    F.add(file, rw + ".name.matches", f"does not match the series {s}")
                    continue
                # The adapter's `as` takes Go's $1 / ${1} for the groups of `matches`.
                to = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", name.get("as") or "")
                as_ = re.sub(name["matches"], to, s) if to and name.get("matches") else s
                served[as_] = s
            for res, m in ((r.get("resources") or {}).get("overrides") or {}).items():
                if (m or {}).get("resource") not in ("namespace", "pod"):
                    F.add(file, f"{rw}.resources.overrides.{res}", "per-pod metrics need namespace and pod")
    return served


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deploy", default=os.path.join(ROOT, "deploy"), help="the directory to check")
    a = ap.parse_args()
    deploy_dir = os.path.abspath(a.deploy)
    t0 = time.monotonic()

    gflags, genvs = long_flags(*GOVERN_ARGS)
    sflags, _ = long_flags(*SWEEP_ARGS)
    exposed = governor_metrics()
    labels = governor_labels()
    ctx = {"govern_flags": gflags, "govern_envs": genvs, "sweep_flags": sflags, "pvcs": set(),
           "vllm": [], "wanted_keys": [], "profile": None, "envs": envelope_env_names()}

    # deploy/ and its variants (deploy/llm-d/), each with its kustomization;
    # the schemas live in deploy/schemas/ for all.
    variants = [deploy_dir] + [os.path.join(deploy_dir, d) for d in VARIANTS
                               if os.path.isdir(os.path.join(deploy_dir, d))]
    objects, validated, generated = [], set(), {}
    for vdir in variants:
        for fn in sorted(os.listdir(vdir)):
            if not fn.endswith((".yaml", ".yml")) or fn in NOT_MANIFESTS:
                continue
            path = os.path.join(vdir, fn)
            validated.add(path)
            for i, d in enumerate(load_yaml(path)):
                if not isinstance(d, dict) or not all(k in d for k in ("apiVersion", "kind", "metadata")):
                    F.add(rel(path), f"document {i}", "not a Kubernetes object (apiVersion, kind, metadata)")
                    continue
                validate_object(d, rel(path), deploy_dir)
                objects.append((rel(path), d))
    if not objects:
        F.add(rel(deploy_dir), "(files)", "no Kubernetes manifests found")
    by_kind = {}
    for file, o in objects:
        by_kind.setdefault(o["kind"], []).append((file, o))
    ctx["pvcs"] = {o["metadata"].get("name") for _, o in by_kind.get("PersistentVolumeClaim", [])}
    configmaps = {o["metadata"].get("name"): o.get("data") or {} for _, o in by_kind.get("ConfigMap", [])}
    for vdir in variants:
        kpath = os.path.join(vdir, "kustomization.yaml")
        if os.path.exists(kpath):
            generated.update(check_kustomization(kpath, vdir, ctx, validated))
        else:
            F.add(rel(kpath), "(file)", "missing")

    for file, o in objects:
        spec = pod_specs(o)
        if spec is None:
            continue
        check_pod(o, file, spec, ctx)
        if o["kind"] == "Deployment":
            sel = ((o["spec"].get("selector") or {}).get("matchLabels")) or {}
            if not labels_match(sel, o["spec"]["template"].get("metadata", {}).get("labels")):
                F.add(file, f"Deployment/{o['metadata']['name']} spec.selector", "does not match the pod template's labels")
        for _, c in all_containers(spec):
            if role(c) != "governor":
                continue
            own, passed, public = governor_get_paths(c.get("args") or [])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = ((c.get(probe) or {}).get("httpGet") or {}).get("path")
                w = f"{o['kind']}/{o['metadata']['name']} containers.{c['name']}.{probe}.httpGet.path"
                if p and p.startswith("/admin"):
                    F.add(file, w, f"{p} answers loopback or the admin token only, not the kubelet")
                elif p and p not in own and not allowed(p, passed):
                    F.add(file, w, f"{p} is neither the governor's own ({', '.join(sorted(own))}) nor passed through ({', '.join(passed)})")
                elif p and not allowed(p, public):
                    F.add(file, w, f"{p} needs an API key once the tenants file lists any, and the kubelet sends none: add it to --public-paths ({', '.join(public)})")

    # ConfigMap keys the containers read: the bench config and tenants file fields too.
    for file, where, names, key, *what in ctx["wanted_keys"]:
        text, shown = None, f"{file} ({key})"
        for n in names:
            if key in generated.get(n, {}):
                src = generated[n][key]
                text, shown = (read(src) if os.path.exists(src) else ""), rel(src)
            elif key in configmaps.get(n, {}):
                text = configmaps[n][key]
        if text is None:
            F.add(file, where, f"{key} is a key of no ConfigMap {names} made in deploy/")
            continue
        if not text:
            continue  # profile.json, copied in from the sweep
        sources, struct = (BENCH_CONFIG, "RawConfig") if what == ["bench"] else (TENANTS, "TenantsConfig")
        if key.endswith(".toml"):
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                F.add(shown, "(toml)", str(e))
                continue
            check_toml_fields(data, sources, struct, shown)
    if ctx["profile"] and os.path.exists(ctx["profile"]):
        p = ctx["profile"]
        if os.path.getsize(p) > CONFIGMAP_MAX * 0.9:
            F.add(rel(p), "(size)", f"{os.path.getsize(p)} bytes: too close to a ConfigMap's 1 MiB")
        try:
            jsonschema.Draft202012Validator(json.loads(read(PROFILE_SCHEMA))).validate(json.loads(read(p)))
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            F.add(rel(p), ".".join(str(x) for x in getattr(e, "absolute_path", [])) or "(top)",
                  f"not a profile ({PROFILE_SCHEMA}): {getattr(e, 'message', e)}")

    # The sweep measured the server the governor protects, on the same nodes.
    if len(ctx["vllm"]) > 1:
        f0, w0, c0, ns0 = ctx["vllm"][0]
        for f, w, c, ns in ctx["vllm"][1:]:
            for key in ("image", "command", "args"):
                if c.get(key) != c0.get(key):
                    F.add(f, f"{w} vllm.{key}", f"differs from {f0} {w0}: the profile would not describe the served vLLM")
            if ns != ns0:
                F.add(f, f"{w} nodeSelector", f"differs from {f0} {w0}: another node type than the profile's")

    deployments = [(f, o) for f, o in by_kind.get("Deployment", [])]
    for file, s in by_kind.get("Service", []):
        w = f"Service/{s['metadata']['name']}"
        sel = (s.get("spec") or {}).get("selector") or {}
        pods = [o for _, o in deployments if labels_match(sel, o["spec"]["template"]["metadata"].get("labels"))]
        if not pods:
            F.add(file, f"{w} spec.selector", "selects no pod template in deploy/")
        for o in pods:
            gov = [c for _, c in all_containers(o["spec"]["template"]["spec"]) if role(c) == "governor"]
            ports = {p.get(k) for c in gov for p in c.get("ports") or [] for k in ("name", "containerPort")}
            for i, p in enumerate(s["spec"].get("ports") or []):
                if p.get("targetPort", p.get("port")) not in ports:
                    F.add(file, f"{w} spec.ports[{i}].targetPort", f"{p.get('targetPort')} is not a port of the governor container")
    services = by_kind.get("Service", [])
    for file, m in by_kind.get("ServiceMonitor", []):
        w = f"ServiceMonitor/{m['metadata']['name']}"
        sel = ((m.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        hit = [s for _, s in services if labels_match(sel, s["metadata"].get("labels"))]
        if not hit:
            F.add(file, f"{w} spec.selector", "selects no Service in deploy/")
        names = {p.get("name") for s in hit for p in s["spec"].get("ports") or []}
        for i, e in enumerate(m["spec"].get("endpoints") or []):
            if e.get("port") not in names:
                F.add(file, f"{w} spec.endpoints[{i}].port", f"{e.get('port')} is not a port name of the Service")
            if e.get("path", "/metrics") != "/metrics":
                F.add(file, f"{w} spec.endpoints[{i}].path", "the governor's metrics are at /metrics")
    served = adapter_rules(objects, exposed, labels)
    for file, h in by_kind.get("HorizontalPodAutoscaler", []):
        w = f"HorizontalPodAutoscaler/{h['metadata']['name']}"
        ref = h["spec"].get("scaleTargetRef") or {}
        if not any(o["kind"] == ref.get("kind") and o["metadata"].get("name") == ref.get("name") for _, o in objects):
            F.add(file, f"{w} spec.scaleTargetRef", f"{ref.get('kind')}/{ref.get('name')} is defined in no file of deploy/")
        for i, m in enumerate(h["spec"].get("metrics") or []):
            t = m.get("type", "")
            key = t[:1].lower() + t[1:]
            if t not in ("Pods", "Object", "External"):
                continue
            name = ((m.get(key) or {}).get("metric") or {}).get("name", "")
            mw = f"{w} spec.metrics[{i}].{key}.metric.name"
            if name not in served:
                F.add(file, mw, f"{name} is served by no prometheus-adapter rule in deploy/ ({', '.join(sorted(served)) or 'none'})")
            elif exposed.get(served[name], ("", ""))[1] != "gauge":
                F.add(file, mw, f"{served[name]} is not a governor gauge (an average per pod needs one)")

    count = 0
    dash = os.path.join(deploy_dir, "grafana-dashboard.json")
    if os.path.exists(dash):
        count = check_dashboard(dash, exposed, labels)
    else:
        F.add(rel(dash), "(file)", "missing")
    dockerfile = os.path.join(deploy_dir, "Dockerfile")
    if os.path.exists(dockerfile):
        check_dockerfile(dockerfile, ctx)
    picker = []
    for vdir in variants[1:]:
        mine = [(f, o) for f, o in objects if os.path.dirname(os.path.join(ROOT, f)) == vdir]
        picker.append(validate_llm_d.check(vdir, mine, exposed, labels,
                                           lambda o: [(role(c), c) for _, c in all_containers(pod_specs(o))]))

    took = time.monotonic() - t0
    kinds = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_kind.items()))
    print(f"deploy: {len(validated)} manifest files ({kinds}) against Kubernetes "
          f"{' and '.join(K8S_VERSIONS)} (strict); {count} dashboard queries against "
          f"{len(exposed)} governor series; {len(gflags)} govern flags, {len(sflags)} sweep flags"
          + "".join(f"; {p}" for p in picker))
    if F.items:
        for item in F.items:
            print("FAIL " + item, file=sys.stderr)
        print(f"deploy: {len(F.items)} failure(s) in {took:.1f} s", file=sys.stderr)
        return 1
    print(f"deploy: all checks passed in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
