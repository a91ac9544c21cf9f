"""The Grafana dashboard only queries series that exist.

Every PromQL expression in deploy/grafana/dashboards/specserve.json (panel targets and
template-variable queries) must name either a recording rule of
deploy/prometheus/rules.yml or a metric that server.metrics registers, so a renamed
metric or a typo fails here instead of showing "No data" in Grafana.

Metric names are pulled out of PromQL with a deliberately small lexer, not a parser:

1. drop string literals (label values such as "$model"), the contents of label matchers
   `{...}` and range selectors `[...]`, and grouping clauses such as `by (model, le)` or
   `ignoring (position)`, whose label names would otherwise look like metrics;
2. take every identifier `[a-zA-Z_:][a-zA-Z0-9_:]*` that is not glued to a preceding word
   character, `:`, `.` or `$` (so no `5m`, `1e3`, `$model`) and is followed by `{`, `[`,
   `)`, whitespace or the end; a function call is followed by `(` and so never matches;
3. discard PromQL keywords and aggregation operators (`sum`, `by`, `group_left`, `le`...).
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

import server.metrics  # noqa: F401  (importing it registers every specserve_* metric)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specserve.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DATASOURCE_UID = "${datasource}"

# Words that step 2 can pick up but are not metrics: aggregation operators and functions
# written with a space before their parenthesis, binary/set operators, modifiers,
# grouping keywords, the `le` bucket label and the number literals Inf and NaN.
PROMQL_WORDS = frozenset(
    {
        # aggregation operators
        "sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk",
        "quantile", "count_values", "limitk", "limit_ratio",
        # grouping and vector matching
        "by", "without", "on", "ignoring", "group_left", "group_right", "le",
        # operators and modifiers
        "and", "or", "unless", "bool", "offset", "atan2", "start", "end",
        # common functions, in case one is written as `rate (x[1m])`
        "rate", "irate", "increase", "delta", "idelta", "deriv", "changes", "resets",
        "histogram_quantile", "histogram_count", "histogram_sum", "histogram_fraction",
        "histogram_avg", "label_replace", "label_join", "abs", "ceil", "floor", "round",
        "clamp", "clamp_min", "clamp_max", "exp", "ln", "log2", "log10", "sqrt", "scalar",
        "vector", "time", "timestamp", "sort", "sort_desc", "absent", "absent_over_time",
        "predict_linear", "avg_over_time", "min_over_time", "max_over_time",
        "sum_over_time", "count_over_time", "last_over_time", "quantile_over_time",
        # literals
        "inf", "nan",
    }
)  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?=[{\[)\s]|$)")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.*),\s*(?P<label>\w+)\s*\)\s*$")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def extract_metric_names(expr: str) -> set[str]:
    """Metric and recording-rule names an expression selects (see the module docstring)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("{}", text)
    text = _RANGE.sub("[]", text)
    text = _GROUPING.sub(" ", text)
    return {name for name in _NAME.findall(text) if name.lower() not in PROMQL_WORDS}


def recording_rules() -> set[str]:
    """Every `record:` name in the Prometheus rule file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def registered_series() -> set[str]:
    """Series names the default registry exposes, in the form PromQL selects them.

    Counters only as `<name>_total`; histograms as the family name (what
    `_bucket`/`_sum`/`_count` strip back to) and `<name>_bucket`; everything else by name.
    A counter without `_total` is therefore unknown, as it is to Prometheus.
    """
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type in ("histogram", "gaugehistogram"):
            names.update({family.name, f"{family.name}_bucket"})
        else:
            names.add(family.name)
    return names


def strip_histogram_suffix(name: str) -> str:
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def unknown_names(expr: str, known: set[str]) -> set[str]:
    return {
        name
        for name in extract_metric_names(expr)
        if name not in known and strip_histogram_suffix(name) not in known
    }


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """All panels, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query")
    if isinstance(query, dict):
        query = query.get("query")
    return query or variable.get("definition", "")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def known_names() -> set[str]:
    return recording_rules() | registered_series()


@pytest.fixture(scope="module")
def data_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Panels that query data; rows only group them."""
    return [p for p in iter_panels(dashboard["panels"]) if p["type"] != "row"]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("sum by (endpoint) (specserve_requests_in_flight)", {"specserve_requests_in_flight"}),
        (
            'histogram_quantile(0.95, sum by (model, le) (rate(a_seconds_bucket{model=~"$model",'
            ' x="{y}"}[$__rate_interval])))',
            {"a_seconds_bucket"},
        ),
        (
            "sum by (model, position) (rate(a_total[1m]))\n/ ignoring (position) group_left\n"
            "sum by (model) (rate(b_total[1m]))",
            {"a_total", "b_total"},
        ),
        ("1 + x:y:rate1m{tenant=~'a|b'} offset 5m > bool 1e3", {"x:y:rate1m"}),
        ('up{job="specserve"} == 0 and on (model) c', {"up", "c"}),
    ],
)
def test_extract_metric_names(expr: str, names: set[str]) -> None:
    assert extract_metric_names(expr) == names


def test_dashboard_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "specserve"
    assert dashboard["title"] == "specserve: is speculation paying?"
    assert dashboard["schemaVersion"] == 39


def test_panel_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in iter_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"


def test_every_panel_has_targets_with_expressions(data_panels: list[dict[str, Any]]) -> None:
    assert data_panels
    for panel in data_panels:
        assert panel.get("description"), f"panel {panel['title']!r} has no description"
        assert panel.get("targets"), f"panel {panel['title']!r} has no targets"
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"empty expr in {panel['title']!r}"


def test_every_panel_uses_the_datasource_variable(
    dashboard: dict[str, Any], data_panels: list[dict[str, Any]]
) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in data_panels:
        assert panel["datasource"]["uid"] == DATASOURCE_UID, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DATASOURCE_UID, panel["title"]


def test_panel_queries_reference_existing_metrics(
    data_panels: list[dict[str, Any]], known_names: set[str]
) -> None:
    problems = []
    for panel in data_panels:
        for target in panel["targets"]:
            expr = target["expr"]
            if not extract_metric_names(expr):
                problems.append(f"{panel['title']!r}: no metric found in {expr!r}")
            elif missing := unknown_names(expr, known_names):
                problems.append(f"{panel['title']!r}: unknown {sorted(missing)} in {expr!r}")
    assert not problems, "\n".join(problems)


def test_template_variables_reference_existing_metrics(
    dashboard: dict[str, Any], known_names: set[str]
) -> None:
    query_variables = [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in query_variables} >= {"model", "tenant"}
    for variable in query_variables:
        assert variable["datasource"]["uid"] == DATASOURCE_UID, variable["name"]
        query = variable_query(variable)
        match = _LABEL_VALUES.match(query)
        selector = match["selector"] if match else query
        names = extract_metric_names(selector)
        assert names, f"variable {variable['name']!r} names no metric: {query!r}"
        assert not unknown_names(selector, known_names), f"{variable['name']!r}: {query!r}"
