#!/usr/bin/env python3
"""Validates the manifests in this directory offline.

Kubernetes' own kinds against Kubernetes' published schemas (PyPI kubernetes-validate, strict:
unknown fields fail), for the oldest release whose device plugin API has CDI devices (1.31)
and the newest the package knows. The custom resources (Multus' NetworkAttachmentDefinition,
the MPI Operator's MPIJob) against their CRDs' shape, their pod templates against Kubernetes'
PodTemplate schema. Then what ties the files together: every pod requesting vrdma.io/vnic
asks for one and joins a NetworkAttachmentDefinition of its namespace whose resourceName is
vrdma.io/vnic and whose config runs vrdma-cni; the names the DaemonSet relies on exist.

Usage: validate.py [DIR]  (exit status 0 when everything passes)
"""

import json
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

RESOURCE = "vrdma.io/vnic"
NETWORKS = "k8s.v1.cni.cncf.io/networks"
RESOURCE_NAME = "k8s.v1.cni.cncf.io/resourceName"
VERSIONS = ["1.31.0", kubernetes_validate.utils.latest_version()]

NAD_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "k8s.cni.cncf.io/v1"},
        "kind": {"const": "NetworkAttachmentDefinition"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["config"],
            "additionalProperties": False,
            "properties": {"config": {"type": "string"}},
        },
    },
}

# vrdma-cni's configuration (README, "CNI"): its keys and CNI's, nothing else, so a typo fails.
CNI_CONFIG_SCHEMA = {
    "type": "object",
    "required": ["cniVersion", "name", "type"],
    "additionalProperties": False,
    "properties": {
        "vnic": {"type": "string"},
        "vnicArg": {"type": "string"},
        "limits": {"type": "object"},
        "adminSocket": {"type": "string"},
        "bridge": {"type": "string"},
        "stateDir": {"type": "string"},
        "cniVersion": {"enum": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        "type": {"const": "vrdma-cni"},
        "defaultRoute": {"type": "boolean"},
        "tenant": {"type": "string"},
    },
}

# kubeflow.org/v2beta1 MPIJob (mpi-operator's CRD), the fields it defines.
REPLICA_SCHEMA = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},
    },
}
MPIJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v2beta1"},
        "kind": {"const": "MPIJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["mpiReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "slotsPerWorker": {"type": "integer", "minimum": 1},
                "runLauncherAsWorker": {"type": "boolean"},
                "mpiImplementation": {"enum": ["OpenMPI", "Intel", "MPICH"]},
                "sshAuthMountPath": {"type": "string"},
                "launcherCreationPolicy": {"enum": ["AtStartup", "WaitForWorkersReady"]},
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["None", "Running", "All"]},
                        "ttlSecondsAfterFinished": {"type": "integer"},
                        "activeDeadlineSeconds": {"type": "integer"},
                        "backoffLimit": {"type": "integer"},
                        "suspend": {"type": "boolean"},
                        "managedBy": {"type": "string"},
                        "schedulingPolicy": {"type": "object"},
                    },
                },
                "mpiReplicaSpecs": {
                    "type": "object",
                    "required": ["Launcher", "Worker"],
                    "additionalProperties": False,
                    "properties": {"Launcher": REPLICA_SCHEMA, "Worker": REPLICA_SCHEMA},
                },
            },
        },
    },
}


class Report:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, ok, what):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            print(f"FAIL {what}")

    def validate(self, doc, where):
        """Kubernetes' own kinds, strictly, at every version in VERSIONS."""
        for v in VERSIONS:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
                self.check(True, where)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                self.check(False, f"{where} (Kubernetes {v}): {path}: {e.message}")

    def schema(self, doc, schema, where):
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
        self.check(not errors, where + "".join(f"\n  {'.'.join(map(str, e.path))}: {e.message}" for e in errors))


def pod_templates(doc):
    """(namespace, where, pod metadata, pod spec) of every pod a document makes."""
    ns = doc["metadata"].get("namespace", "default")
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc["kind"] == "Pod":
        yield ns, name, doc["metadata"], doc["spec"]
    elif doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job", "ReplicaSet"):
        t = doc["spec"]["template"]
        yield ns, name, t.get("metadata", {}), t["spec"]
    elif doc["kind"] == "MPIJob":
        for role, r in doc["spec"]["mpiReplicaSpecs"].items():
            t = r["template"]
            yield ns, f"{name} {role}", t.get("metadata", {}), t["spec"]


def main(directory):
    report = Report()
    docs = []
    for path in sorted(pathlib.Path(directory).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    report.check(len(docs) > 0, f"no manifests in {directory}")

    nads = {}
    for file, doc in docs:
        where = f"{file}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc["kind"] == "NetworkAttachmentDefinition":
            report.schema(doc, NAD_SCHEMA, where)
            try:
                config = json.loads(doc["spec"]["config"])
            except (KeyError, json.JSONDecodeError) as e:
                report.check(False, f"{where}: spec.config is not JSON: {e}")
                continue
            report.schema(config, CNI_CONFIG_SCHEMA, f"{where}: spec.config")
            ns = doc["metadata"].get("namespace", "default")
            nads[(ns, doc["metadata"]["name"])] = doc["metadata"].get("annotations", {}).get(RESOURCE_NAME)
        elif doc["kind"] == "MPIJob":
            report.schema(doc, MPIJOB_SCHEMA, where)
            for role, r in doc["spec"]["mpiReplicaSpecs"].items():
                template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()}, "template": r["template"]}
                report.validate(template, f"{where} {role} template")
        else:
            report.validate(doc, where)

    namespaces = {d["metadata"]["name"] for _, d in docs if d["kind"] == "Namespace"}
    configmaps = {(d["metadata"].get("namespace"), d["metadata"]["name"]) for _, d in docs if d["kind"] == "ConfigMap"}
    requesting = 0
    for file, doc in docs:
        ns = doc["metadata"].get("namespace", "default")
        report.check(ns == "default" or ns in namespaces or doc["kind"] == "Namespace", f"{file}: namespace {ns} is not defined")
        for ns, where, meta, spec in pod_templates(doc):
            where = f"{file}: {where}"
            for v in spec.get("volumes", []):
                if "configMap" in v:
                    report.check((ns, v["configMap"]["name"]) in configmaps, f"{where}: ConfigMap {v['configMap']['name']} is not defined")
            counts = [c.get("resources", {}).get("limits", {}).get(RESOURCE) for c in spec["containers"]]
            counts = [c for c in counts if c is not None]
            if not counts:
                continue
            requesting += 1
            report.check(counts == [1], f"{where}: one container asks for {RESOURCE}: 1 (a vNIC is the pod's), not {counts}")
            networks = [n.strip() for n in meta.get("annotations", {}).get(NETWORKS, "").split(",") if n.strip()]
            joined = [nads.get(tuple(n.split("/", 1)) if "/" in n else (ns, n)) for n in networks]
            report.check(RESOURCE in joined, f"{where}: no network of {NETWORKS} {networks} is a vrdma NetworkAttachmentDefinition of {RESOURCE}")
    report.check(requesting > 0, f"no pod asks for {RESOURCE}")

    print(f"{report.passed} passed, {report.failed} failed")
    return 0 if report.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent))
