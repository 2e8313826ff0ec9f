"""Readers of the Rust sources for deploy/validate.py: the flags of
`envelope govern` and `envelope sweep`, the fields serde accepts in the
bench config and the tenants file, the governor's metric registrations and
label names, its routes, and the metric names a PromQL expression selects.
They parse the source text (no build), and say so when they cannot.
"""
import difflib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOVERNOR_SRC = "crates/envelope-governor/src"
# The sources whose metrics a governor serves: its own and, with --tiers,
# the router's (one /metrics page).
METRICS_SRC = (GOVERNOR_SRC, "crates/envelope-router/src")
GOVERN_ARGS = ("crates/envelope-governor/src/config.rs", "GovernArgs")
SWEEP_ARGS = ("src/cli.rs", "SweepArgs")
# Where the structs of a bench config (RawConfig) and a tenants file
# (TenantsConfig) and the structs they hold are defined.
BENCH_CONFIG = ["crates/envelope-harness/src/config.rs", "crates/envelope-profile/src/schema.rs"]
TENANTS = ["crates/envelope-governor/src/settings.rs"]
# Labels the Prometheus Operator puts on every target; `le` of histograms.
TARGET_LABELS = {"namespace", "pod", "service", "container", "endpoint", "job", "instance", "le"}
PROFILE_SCHEMA = "profiles/schema/profile.schema.json"


class Failures:
    def __init__(self):
        self.items = []

    def add(self, file, field, message):
        item = f"{file}: {field}: {message}"
        if item not in self.items:
            self.items.append(item)


F = Failures()


def rel(path):
    r = os.path.relpath(path, ROOT)
    return os.path.abspath(path) if r.startswith("..") else r


def read(path):
    with open(os.path.join(ROOT, path) if not os.path.isabs(path) else path) as f:
        return f.read()


# ---------------------------------------------------------------- Rust sources

def rust_block(text, start):
    """The text between the brace at or after `start` and its match."""
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    raise ValueError("unbalanced braces")


def struct_fields(path, name):
    """{field: (type, attribute text)} of `struct name` in path, or None."""
    text = read(path)
    m = re.search(r"\bstruct\s+" + re.escape(name) + r"\b[^;{]*\{", text)
    if not m:
        return None
    body = rust_block(text, m.start())
    fields, attrs, pending, depth = {}, [], "", 0
    for line in body.splitlines():
        s = line.strip()
        if pending:
            pending += " " + s
            depth += s.count("[") - s.count("]")
            if depth <= 0:
                attrs.append(pending)
                pending = ""
            continue
        if not s or s.startswith("//"):
            continue
        if s.startswith("#["):
            depth = s.count("[") - s.count("]")
            if depth > 0:
                pending = s
            else:
                attrs.append(s)
            continue
        fm = re.match(r"(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:\s*(.+?),?$", s)
        if fm:
            fields[fm.group(1)] = (fm.group(2), " ".join(attrs))
        attrs = []
    return fields


def serde_names(field, attrs):
    """Names serde accepts for a field ([] when skipped)."""
    serde = " ".join(re.findall(r"#\[serde\((.*?)\)\]", attrs))
    if re.search(r"\bskip(_deserializing)?\b", serde):
        return []
    r = re.search(r'\brename\s*=\s*"([^"]+)"', serde)
    names = [r.group(1) if r else field]
    names += re.findall(r'\balias\s*=\s*"([^"]+)"', serde)
    return names


def long_flags(path, name):
    """(--flags, ENV names) of a clap Args struct."""
    fields = struct_fields(path, name)
    if fields is None:
        F.add(path, name, "struct not found: the validator cannot read the flags")
        return set(), set()
    flags, envs = set(), set()
    for field, (_, attrs) in fields.items():
        for arg in re.findall(r"#\[arg\((.*?)\)\]", attrs):
            custom = re.search(r'\blong\s*=\s*"([^"]+)"', arg)
            if custom:
                flags.add("--" + custom.group(1))
            elif re.search(r"\blong\b", arg):
                flags.add("--" + field.replace("_", "-"))
            envs.update(re.findall(r'\benv\s*=\s*"([^"]+)"', arg))
    if not flags:
        F.add(path, name, "no long flags found: the validator cannot read the flags")
    return flags, envs


def find_struct(sources, name):
    for path in sources:
        f = struct_fields(path, name)
        if f is not None:
            return f
    return None


def inner_type(t):
    """The struct a field's type holds: Option<X> -> X; maps -> their value type."""
    t = t.strip()
    m = re.fullmatch(r"Option<(.+)>", t)
    if m:
        return inner_type(m.group(1))
    m = re.fullmatch(r"(?:std::collections::)?(?:HashMap|BTreeMap)<\s*String\s*,\s*(.+)>", t)
    if m:
        return ("map", m.group(1).strip())
    return ("one", t)


def check_toml_fields(data, sources, struct, file, at=""):
    """Each key of `data` is a field of `struct` (from the Rust sources)."""
    fields = find_struct(sources, struct)
    if fields is None:
        F.add(file, at or "(top)", f"struct {struct} not found in the sources")
        return
    accepted = {}
    for field, (t, attrs) in fields.items():
        for n in serde_names(field, attrs):
            accepted[n] = t
    for key, value in data.items():
        where = f"{at}.{key}" if at else key
        if key not in accepted:
            F.add(file, where, f"not a field of {struct} ({', '.join(sorted(accepted))})")
            continue
        kind, inner = inner_type(accepted[key])
        if kind == "map" and isinstance(value, dict) and find_struct(sources, inner):
            for k, v in value.items():
                if isinstance(v, dict):
                    check_toml_fields(v, sources, inner, file, f"{where}.{k}")
        elif isinstance(value, dict) and find_struct(sources, inner):
            check_toml_fields(value, sources, inner, file, where)


# ---------------------------------------------------------------- metrics

REG_CALL = re.compile(r'(?:\breg!|\.register)\(\s*"')
REG = re.compile(
    r'(?:\breg!|\.register)\(\s*"([^"]+)"\s*,\s*"(?:[^"\\]|\\.)*"\s*,\s*'
    r'm\.(\w+)(?:\.family)?(?:\.clone\(\))?\s*,?\s*\)', re.S)


def governor_metrics():
    """{exposed series name: (registered name, kind)} from the governor's sources."""
    out = {}
    walked = [w for src in METRICS_SRC for w in sorted(os.walk(os.path.join(ROOT, src)))]
    for dirpath, _, files in walked:
        for fn in sorted(files):
            if not fn.endswith(".rs"):
                continue
            path = rel(os.path.join(dirpath, fn))
            text = read(path)
            calls = len(REG_CALL.findall(text))
            if not calls:
                continue
            if re.search(r"\.register_with_unit\(|\.sub_registry_with_\w+\(|Registry::with_(prefix_and_)?labels", text):
                F.add(path, "Registry", "units, sub-registries or constant labels: the validator does not model their names")
            prefix = re.findall(r'Registry::with_prefix\(\s*"([^"]+)"', text)
            if len(prefix) > 1 or (not prefix and "Registry::default()" not in text):
                F.add(path, "Registry", "cannot tell the registry's prefix")
            pre = prefix[0] + "_" if prefix else ""
            types = dict(re.findall(r"^\s*pub\s+(\w+)\s*:\s*([^\n]+?),\s*$", text, re.M))
            found = REG.findall(text)
            if len(found) != calls:
                F.add(path, "register", f"{calls} registrations, {len(found)} read: the validator cannot parse them all")
            for name, field in found:
                t = types.get(field, "")
                full = pre + name
                if "Histogram" in t:
                    series = [full + s for s in ("_bucket", "_sum", "_count")]
                    kind = "histogram"
                elif "Counter" in t:
                    series, kind = [full + "_total"], "counter"
                elif "Gauge" in t:
                    series, kind = [full], "gauge"
                elif "Info" in t:
                    series, kind = [full + "_info"], "info"
                else:
                    F.add(path, field, f"type of the metric {name} unknown: {t or 'field not found'}")
                    continue
                for s in series:
                    out[s] = (full, kind)
    if not out:
        F.add(GOVERNOR_SRC, "register", "no metric registrations found")
    return out


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right",
                "bool", "and", "or", "unless", "offset", "inf", "nan"}


def promql_metrics(expr):
    """Metric names a PromQL expression selects (Grafana and adapter templates allowed)."""
    e = re.sub(r"<<[^>]*>>", " ", expr)
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', e)
    e = re.sub(r"\{[^{}]*\}", " ", e)
    e = re.sub(r"\[[^\[\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", e)
    names = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        before = e[m.start() - 1] if m.start() else " "
        if before.isdigit() or before in ".$":
            continue
        if e[m.end():].lstrip().startswith("("):
            continue  # a function or an aggregation
        if word.lower() in PROMQL_WORDS:
            continue
        names.append(word)
    return names


def governor_labels():
    """Label names the governor's sources give metrics, and the targets' own."""
    out = set(TARGET_LABELS)
    walked = [w for src in METRICS_SRC for w in os.walk(os.path.join(ROOT, src))]
    for dirpath, _, files in walked:
        for fn in files:
            if fn.endswith(".rs"):
                text = read(os.path.join(dirpath, fn))
                out.update(re.findall(r'\blabel\(\s*"(\w+)"', text))
                out.update(re.findall(r'\bWordCounters::new\(\s*"(\w+)"', text))
                for pairs in re.findall(r"\blabels\(\s*&\[(.*?)\]\s*\)", text, re.S):
                    out.update(re.findall(r'\(\s*"(\w+)"\s*,', pairs))
    return out


def envelope_env_names():
    """ENVELOPE_* variable names the Rust sources spell out."""
    out = set()
    for base in ["src"] + [os.path.join("crates", c, "src") for c in os.listdir(os.path.join(ROOT, "crates"))]:
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            for fn in files:
                if fn.endswith(".rs"):
                    out.update(re.findall(r'"(ENVELOPE_[A-Z0-9_]+)"', read(os.path.join(dirpath, fn))))
    return out


def promql_labels(expr):
    """Label names an expression matches on or groups by."""
    e = re.sub(r"<<[^>]*>>", " ", expr)
    e = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', e)
    names = []
    for block in re.findall(r"\{([^{}]*)\}", e):
        names += re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", block)
    for _, group in re.findall(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", e):
        names += [n.strip() for n in group.split(",") if n.strip()]
    return names


def check_expr(expr, exposed, file, field, need_one=True, labels=None):
    names = promql_metrics(expr)
    if need_one and not names:
        F.add(file, field, f"no metric name found in {expr!r}")
    for n in names:
        if n not in exposed:
            near = difflib.get_close_matches(n, exposed, n=3, cutoff=0.8)
            F.add(file, field, f"metric {n} is not exposed by the governor"
                  + (f" (similar: {', '.join(near)})" if near else ""))
    for label in promql_labels(expr) if labels else []:
        if label != "__name__" and label not in labels:
            F.add(file, field, f"label {label} is given to no governor metric nor by Prometheus")
    return names


def flag_value(args, flag):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def default_list(fn_name, flag, args):
    """A governor path list: the flag's value, else the default in the
    settings' groups (settings/groups.rs)."""
    given = flag_value(args, flag)
    if given is not None:
        return given.split(",")
    text = read(os.path.join(GOVERNOR_SRC, "settings", "groups.rs"))
    m = re.search(r"fn " + fn_name + r"\(", text)
    return re.findall(r'"([^"]+)"', rust_block(text, m.start())) if m else []


def governor_get_paths(args):
    """GET paths the governor answers itself, the ones it passes through,
    and the ones answered without an API key."""
    own = set()
    text = read(os.path.join(GOVERNOR_SRC, "proxy.rs"))
    app = re.search(r"pub fn app\(", text)
    for path, method in re.findall(r'\.route\(\s*"([^"]+)"\s*,\s*(\w+)\(', rust_block(text, app.start()) if app else ""):
        if method == "get":
            own.add(path)
    passed = default_list("default_passthrough_paths", "--passthrough-paths", args)
    public = default_list("default_public_paths", "--public-paths", args)
    if not own or not passed or not public:
        F.add(GOVERNOR_SRC, "routes", "cannot read the governor's routes, passthrough or public paths")
    return own, passed, public


def allowed(path, patterns):
    return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in patterns)
