"""Structural JSON schemas for the custom resources Jitney ships (KEDA, Prometheus Operator).

kubernetes-validate knows only built-in kinds; these encode the parts of the upstream CRDs that
a typo would break: required fields, field names at each level (no unknown keys where the CRD
has a closed set), and value types. Not the whole CRDs: enough to catch a misspelt field.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_METADATA: Schema = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}


def _resource(api: str, kind: str, spec: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


def _closed(required: list[str], **properties: Schema) -> Schema:
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        "additionalProperties": False,
    }


_STR: Schema = {"type": "string"}
_INT: Schema = {"type": "integer", "minimum": 0}
_LABEL_SELECTOR = _closed(
    [],
    matchLabels={"type": "object", "additionalProperties": _STR},
    matchExpressions={"type": "array"},
)
# Duration strings as Prometheus reads them (30s, 5m, 1h30m).
_DURATION: Schema = {"type": "string", "pattern": r"^([0-9]+(ms|s|m|h|d|w|y))+$"}

_SCALED_OBJECT = _closed(
    ["scaleTargetRef", "triggers"],
    scaleTargetRef=_closed(
        ["name"], name=_STR, kind=_STR, apiVersion=_STR, envSourceContainerName=_STR
    ),
    pollingInterval=_INT,
    cooldownPeriod=_INT,
    initialCooldownPeriod=_INT,
    idleReplicaCount=_INT,
    minReplicaCount=_INT,
    maxReplicaCount=_INT,
    fallback={"type": "object"},
    advanced=_closed(
        [],
        restoreToOriginalReplicaCount={"type": "boolean"},
        horizontalPodAutoscalerConfig=_closed([], name=_STR, behavior={"type": "object"}),
        scalingModifiers={"type": "object"},
    ),
    triggers={
        "type": "array",
        "minItems": 1,
        "items": _closed(
            ["type", "metadata"],
            type=_STR,
            name=_STR,
            metricType={"enum": ["AverageValue", "Value", "Utilization"]},
            useCachedMetrics={"type": "boolean"},
            # KEDA trigger metadata values are all strings.
            metadata={"type": "object", "additionalProperties": _STR},
            authenticationRef=_closed(
                ["name"],
                name=_STR,
                kind={"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
            ),
        ),
    },
)

_TRIGGER_AUTHENTICATION = {
    "type": "object",
    "minProperties": 1,
    "properties": {
        "secretTargetRef": {
            "type": "array",
            "items": _closed(["parameter", "name", "key"], parameter=_STR, name=_STR, key=_STR),
        },
        "env": {"type": "array"},
        "podIdentity": {"type": "object"},
        "hashiCorpVault": {"type": "object"},
        "azureKeyVault": {"type": "object"},
        "awsSecretManager": {"type": "object"},
        "gcpSecretManager": {"type": "object"},
        "configMapTargetRef": {"type": "array"},
    },
    "additionalProperties": False,
}

_ENDPOINT_COMMON: dict[str, Schema] = {
    "port": _STR,
    "path": _STR,
    "scheme": {"enum": ["http", "https"]},
    "interval": _DURATION,
    "scrapeTimeout": _DURATION,
    "honorLabels": {"type": "boolean"},
    "relabelings": {"type": "array"},
    "metricRelabelings": {"type": "array"},
    "params": {"type": "object"},
}

_POD_MONITOR = _closed(
    ["selector", "podMetricsEndpoints"],
    selector=_LABEL_SELECTOR,
    namespaceSelector={"type": "object"},
    jobLabel=_STR,
    podTargetLabels={"type": "array", "items": _STR},
    podMetricsEndpoints={
        "type": "array",
        "minItems": 1,
        "items": _closed([], **_ENDPOINT_COMMON, portNumber=_INT, targetPort={}),
    },
)

_SERVICE_MONITOR = _closed(
    ["selector", "endpoints"],
    selector=_LABEL_SELECTOR,
    namespaceSelector={"type": "object"},
    jobLabel=_STR,
    endpoints={
        "type": "array",
        "minItems": 1,
        "items": _closed([], **_ENDPOINT_COMMON, targetPort={}),
    },
)

_RULE = {
    "type": "object",
    "required": ["expr"],
    "properties": {
        "alert": _STR,
        "record": _STR,
        "expr": _STR,
        "for": _DURATION,
        "keep_firing_for": _DURATION,
        "labels": {"type": "object", "additionalProperties": _STR},
        "annotations": {"type": "object", "additionalProperties": _STR},
    },
    "additionalProperties": False,
    # Exactly one of alert / record.
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}

_PROMETHEUS_RULE = _closed(
    ["groups"],
    groups={
        "type": "array",
        "minItems": 1,
        "items": _closed(
            ["name", "rules"],
            name=_STR,
            interval=_DURATION,
            limit=_INT,
            rules={"type": "array", "minItems": 1, "items": _RULE},
        ),
    },
)

CRD_SCHEMAS: dict[tuple[str, str], Schema] = {
    ("keda.sh/v1alpha1", "ScaledObject"): _resource(
        "keda.sh/v1alpha1", "ScaledObject", _SCALED_OBJECT
    ),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _resource(
        "keda.sh/v1alpha1", "TriggerAuthentication", _TRIGGER_AUTHENTICATION
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): _resource(
        "monitoring.coreos.com/v1", "PodMonitor", _POD_MONITOR
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _resource(
        "monitoring.coreos.com/v1", "ServiceMonitor", _SERVICE_MONITOR
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _resource(
        "monitoring.coreos.com/v1", "PrometheusRule", _PROMETHEUS_RULE
    ),
}
