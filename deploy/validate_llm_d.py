"""Offline checks of deploy/llm-d/, the variant behind llm-d's endpoint
picker (deploy/validate.py runs them after the Kubernetes schemas):

1. epp-config.yaml against deploy/schemas/endpointpickerconfig-llm-d-v1alpha1.json
   (closed objects: the picker decodes strictly), each plugin's parameters
   against its type's, and the schema itself against the Go structs it was
   written from (deploy/schemas/vendor/llm-d-router/: every object's
   properties are its struct's json tags).
2. Within the picker's config: plugin names unique (a name defaults to the
   type), every pluginRef names a plugin, the saturation detector is one,
   feature gates known; every metric spec parses as the picker parses it
   (spec.go) and names a gauge the governor registers, with labels it sets,
   or a vLLM series the picker's own vllm entry reads (passed through by
   --engine-metrics).
3. router-values.yaml carries the same config, turns on alpha plugins if
   the config uses any, and leaves the pool to inferencepool.yaml.
4. The InferencePool selects exactly the governed Deployment's pods, whose
   engine-type label names the engineConfigs entry; targets the governor's
   port; names the chart's picker Service; the governor passes vLLM's
   metrics on. The HTTPRoute sends to that pool and retries 429 only, fewer
   times than the picker lists endpoints.
"""
import json
import os
import re

import jsonschema
import yaml

from validate_sources import F, ROOT, flag_value, read, rel

EPP_SCHEMA = "deploy/schemas/endpointpickerconfig-llm-d-v1alpha1.json"
VENDOR = "deploy/schemas/vendor/llm-d-router"
ENGINE_LABEL = "llm-d.ai/engine-type"  # the extractor's default engineLabelKey
SPEC_FIELDS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
               "cacheInfoSpec", "cacheBlockSizeSpec", "cacheNumBlocksSpec")
# The fields that may read vLLM's own series (passed through by
# --engine-metrics): what it serves besides load. Load is the governor's.
ENGINE_FIELDS = ("loraSpec", "cacheInfoSpec")
# Plugins the picker injects a default of unless one of exactly this name
# exists (ensureDataLayer): renamed, a second, vLLM-reading one appears.
DEFAULT_NAMED = ("metrics-data-source", "core-metrics-extractor")
# The picker's spec grammar (vendor/llm-d-router/spec.go), and Prometheus'
# legacy name rules.
SPEC_RE = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")
PAIR_RE = re.compile(r'^\s*(\S+?)\s*=\s*"([^"]*)"\s*$')
QUOTE_RE = re.compile(r'(\w+)\s*=\s*([^",}\s]+)')
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def parse_spec(spec):
    """(name, {label: value}) of a metric spec, as the picker parses it."""
    m = SPEC_RE.match(QUOTE_RE.sub(r'\1="\2"', spec))
    if not m or not METRIC_NAME.match(m.group(1)):
        raise ValueError(f"not a valid metric specification: {spec!r}")
    labels = {}
    block = (m.group(2) or "").strip()
    for pair in block.split(",") if block else []:
        lm = PAIR_RE.match(pair)
        if not lm or not LABEL_NAME.match(lm.group(1)):
            raise ValueError(f"invalid label pair {pair!r} in {spec!r}")
        labels[lm.group(1)] = lm.group(2)
    return m.group(1), labels


def go_struct_tags(path, name):
    """The json tag names of struct `name` in a vendored Go file (a
    `type name struct` or a `name struct` inside a type group), or None."""
    text = read(path)
    m = re.search(r"(?m)^\s*(?:type\s+)?" + re.escape(name) + r"\s+struct\s*\{", text)
    if not m:
        return None
    depth, i = 0, m.end() - 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            body = text[i + 1:j]
            break
    tags = re.findall(r'json:"([^",]*)[^"]*"', body)
    return {t for t in tags if t and t != "-"}


def check_schema_mirrors_vendored(schema):
    objects = [("(top)", schema)] + list(schema.get("$defs", {}).items())
    checked = 0
    for where, s in objects:
        struct = s.get("x-go-struct")
        if not struct:
            continue
        fn, name = struct.split(":")
        tags = go_struct_tags(os.path.join(VENDOR, fn), name)
        if tags is None:
            F.add(EPP_SCHEMA, f"$defs.{where}", f"struct {name} not found in {VENDOR}/{fn}")
            continue
        props = set(s.get("properties", {})) - set(s.get("x-go-inline", []))
        if props != tags:
            F.add(EPP_SCHEMA, f"$defs.{where}.properties",
                  f"differ from {name}'s json tags in {fn}: only in the schema {sorted(props - tags)}, "
                  f"only in the struct {sorted(tags - props)}")
        checked += 1
    return checked


def vllm_entry_series():
    """The series the picker's built-in vllm entry reads (factories.go)."""
    text = read(os.path.join(VENDOR, "factories.go"))
    m = re.search(r'Name:\s*"vllm",(.*?)\n\t\}', text, re.S)
    return set(re.findall(r':\s*"(vllm:[a-z_:]+)"', m.group(1))) if m else set()


def check_epp_config(cfg, file, exposed, labels):
    """Schema, references and metric specs of one EndpointPickerConfig."""
    schema = json.loads(read(EPP_SCHEMA))
    for e in jsonschema.Draft202012Validator(schema).iter_errors(cfg):
        F.add(file, ".".join(str(p) for p in e.absolute_path) or "(top)", e.message)
    types = schema["x-plugin-types"]
    plugins = {}
    for i, p in enumerate(cfg.get("plugins") or []):
        t, name = p.get("type"), p.get("name") or p.get("type")
        where = f"plugins[{i}]({name})"
        if name in plugins:
            F.add(file, where + ".name", f"{name} names two plugins")
        plugins[name] = p
        if t in DEFAULT_NAMED and name != t:
            F.add(file, where + ".name", f"must be {t} (or left out): under another name the picker adds a default {t} beside it")
        if t not in types:
            F.add(file, where + ".type", f"{t}: a type deploy/schemas does not describe ({', '.join(sorted(types))})")
            continue
        params = types[t].get("parameters")
        if params is None and "parameters" in p:
            F.add(file, where + ".parameters", f"{t} takes none that deploy/schemas knows")
        elif params is not None and "parameters" in p:
            sub = dict(schema["$defs"][params], **{"$defs": schema["$defs"]})
            for e in jsonschema.Draft202012Validator(sub).iter_errors(p["parameters"]):
                path = ".".join(str(x) for x in e.absolute_path)
                F.add(file, f"{where}.parameters{'.' + path if path else ''}", e.message)
    for i, prof in enumerate(cfg.get("schedulingProfiles") or []):
        for j, ref in enumerate(prof.get("plugins") or []):
            if ref.get("pluginRef") not in plugins:
                F.add(file, f"schedulingProfiles[{i}].plugins[{j}].pluginRef", f"{ref.get('pluginRef')}: no such plugin")
    for where, det in (("flowControl.saturationDetector", (cfg.get("flowControl") or {}).get("saturationDetector")),
                       ("saturationDetector", cfg.get("saturationDetector"))):
        ref = (det or {}).get("pluginRef")
        if ref and types.get((plugins.get(ref) or {}).get("type"), {}).get("kind") != "saturation-detector":
            F.add(file, where + ".pluginRef", f"{ref}: not a saturation detector plugin")
    engines = {}
    passed = vllm_entry_series()
    for p in plugins.values():
        if p.get("type") != "core-metrics-extractor":
            continue
        for k, ec in enumerate((p.get("parameters") or {}).get("engineConfigs") or []):
            ew = f"plugins({p.get('name') or p['type']}).parameters.engineConfigs[{k}]({ec.get('name')})"
            specs = [(f, ec.get(f)) for f in SPEC_FIELDS if ec.get(f)]
            specs += [(f"customMetrics[{n}]", c.get("metricSpec"))
                      for n, c in enumerate(ec.get("customMetrics") or [])]
            for field, spec in specs:
                try:
                    name, want = parse_spec(spec)
                except ValueError as e:
                    F.add(file, f"{ew}.{field}", str(e))
                    continue
                if name in passed and field in ENGINE_FIELDS:
                    continue
                if name in passed:
                    F.add(file, f"{ew}.{field}", f"{name} is vLLM's: a governed pod's load is read from the governor's gauges (vLLM's series only for {', '.join(ENGINE_FIELDS)})")
                elif name not in exposed:
                    F.add(file, f"{ew}.{field}", f"{name} is neither a series the governor registers nor one of vLLM's the picker reads ({', '.join(sorted(passed))})")
                elif exposed[name][1] != "gauge":
                    F.add(file, f"{ew}.{field}", f"{name} is a {exposed[name][1]}, not a gauge of the pod's state now")
                for label in want:
                    if label not in labels:
                        F.add(file, f"{ew}.{field}", f"label {label} is set on no governor series")
            engines[ec.get("name")] = ec
    return plugins, engines, types


def check_router_values(path, cfg, uses_alpha, pool):
    file = rel(path)
    try:
        v = yaml.safe_load(read(path)) or {}
    except yaml.YAMLError as e:
        F.add(file, "(yaml)", str(e).replace("\n", " "))
        return
    epp = (v.get("router") or {}).get("epp") or {}
    name = epp.get("pluginsConfigFile")
    text = (epp.get("pluginsCustomConfig") or {}).get(name)
    if text is None:
        F.add(file, "router.epp.pluginsCustomConfig", f"has no {name} (router.epp.pluginsConfigFile)")
    elif yaml.safe_load(text) != cfg:
        F.add(file, f"router.epp.pluginsCustomConfig.{name}", "differs from deploy/llm-d/epp-config.yaml")
    if uses_alpha and (epp.get("flags") or {}).get("allow-experimental-plugins") is not True:
        F.add(file, "router.epp.flags.allow-experimental-plugins", f"must be true: the config uses alpha plugins ({', '.join(uses_alpha)})")
    if ((v.get("router") or {}).get("inferencePool") or {}).get("create") is not False:
        F.add(file, "router.inferencePool.create", "must be false: deploy/llm-d/inferencepool.yaml is the pool")
    ms = (v.get("router") or {}).get("modelServers") or {}
    if pool is not None:
        if ms.get("matchLabels") != pool["spec"]["selector"].get("matchLabels"):
            F.add(file, "router.modelServers.matchLabels", "differs from the InferencePool's selector")
        if ms.get("targetPorts") != pool["spec"].get("targetPorts"):
            F.add(file, "router.modelServers.targetPorts", "differs from the InferencePool's targetPorts")


def check(variant_dir, objects, exposed, labels, pod_containers):
    """All of the above for `variant_dir`; `objects` are its manifests
    ((file, object) pairs, already checked against their schemas);
    `pod_containers(obj)` lists a workload's containers with their roles."""
    cfg_path = os.path.join(variant_dir, "epp-config.yaml")
    file = rel(cfg_path)
    if not os.path.exists(cfg_path):
        F.add(file, "(file)", "missing")
        return "no picker config"
    cfg = yaml.safe_load(read(cfg_path)) or {}
    mirrored = check_schema_mirrors_vendored(json.loads(read(EPP_SCHEMA)))
    plugins, engines, types = check_epp_config(cfg, file, exposed, labels)
    alpha = sorted({p["type"] for p in plugins.values() if types.get(p.get("type"), {}).get("stability") == "alpha"})
    pickers = [p for p in plugins.values() if p.get("type") == "max-score-picker"]
    listed = max([(p.get("parameters") or {}).get("maxNumOfEndpoints", 1) for p in pickers] or [1])

    pools = [(f, o) for f, o in objects if o.get("kind") == "InferencePool"]
    deployments = [(f, o) for f, o in objects if o.get("kind") == "Deployment"]
    if len(pools) != 1:
        F.add(rel(variant_dir), "InferencePool", f"{len(pools)} found: one pool is what the picker's chart serves")
    for pf, pool in pools:
        pw = f"InferencePool/{pool['metadata']['name']}"
        sel = pool["spec"]["selector"].get("matchLabels") or {}
        hit = [(f, d) for f, d in deployments
               if all((d["spec"]["template"]["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())]
        if len(hit) != 1:
            F.add(pf, f"{pw} spec.selector", f"selects {len(hit)} Deployments' pods, not the governed one")
        ref = pool["spec"].get("endpointPickerRef") or {}
        if ref.get("name") != pool["metadata"]["name"] + "-epp":
            F.add(pf, f"{pw} spec.endpointPickerRef.name", f"llm-d-router's chart names its picker Service <release>-epp and serves the pool named <release>: expected {pool['metadata']['name']}-epp")
        if (ref.get("port") or {}).get("number") != 9002:
            F.add(pf, f"{pw} spec.endpointPickerRef.port.number", "the chart's picker serves ext_proc on 9002")
        for df, d in hit:
            tl = d["spec"]["template"]["metadata"].get("labels") or {}
            engine = tl.get(ENGINE_LABEL)
            if engine not in engines:
                F.add(df, f"Deployment/{d['metadata']['name']} template labels.{ENGINE_LABEL}", f"{engine!r} names no engineConfigs entry of epp-config.yaml ({', '.join(map(str, engines))}): the picker would read vLLM's gauges")
            govs = [c for role, c in pod_containers(d) if role == "governor"]
            if not govs:
                F.add(df, f"Deployment/{d['metadata']['name']}", "no governor container: the pool would route to vLLM")
            for c in govs:
                args = c.get("args") or []
                port = (flag_value(args, "--listen") or "127.0.0.1:9000").rsplit(":", 1)[-1]
                targets = [str(t.get("number")) for t in pool["spec"].get("targetPorts") or []]
                if targets != [port]:
                    F.add(pf, f"{pw} spec.targetPorts", f"{targets}: not the governor's port {port} alone")
                if flag_value(args, "--engine-metrics") != "true":
                    F.add(df, f"Deployment/{d['metadata']['name']} containers.{c.get('name')}.args --engine-metrics",
                          "must be true: the picker scrapes the governor's port only, and the config reads vLLM series there")
    for rf, route in ((f, o) for f, o in objects if o.get("kind") == "HTTPRoute"):
        rw = f"HTTPRoute/{route['metadata']['name']}"
        for i, rule in enumerate(route["spec"].get("rules") or []):
            for j, b in enumerate(rule.get("backendRefs") or []):
                if b.get("kind") != "InferencePool" or b.get("name") not in {p["metadata"]["name"] for _, p in pools}:
                    F.add(rf, f"{rw} spec.rules[{i}].backendRefs[{j}]", "not the InferencePool of this directory")
            retry = rule.get("retry")
            if retry is None:
                continue
            if "attempts" not in retry:
                F.add(rf, f"{rw} spec.rules[{i}].retry.attempts", "missing: the default is the gateway's, and may exceed the endpoints the picker lists")
            if set(retry.get("codes") or []) != {429}:
                F.add(rf, f"{rw} spec.rules[{i}].retry.codes", "429 only: a 5xx may come after the upstream started the work")
            if retry.get("attempts", 1) >= listed:
                F.add(rf, f"{rw} spec.rules[{i}].retry.attempts", f"{retry.get('attempts')}: the picker lists {listed} endpoints (maxNumOfEndpoints), so a retry past the {listed - 1} others goes back to a pod already tried")
    values = os.path.join(variant_dir, "router-values.yaml")
    if os.path.exists(values):
        check_router_values(values, cfg, alpha, pools[0][1] if pools else None)
    else:
        F.add(rel(values), "(file)", "missing")
    specs = sum(len([f for f in SPEC_FIELDS if ec.get(f)]) + len(ec.get("customMetrics") or []) for ec in engines.values())
    return (f"picker config: {len(plugins)} plugins, {specs} metric specs against the governor's "
            f"registrations, schema mirrors {mirrored} vendored Go structs")
