// Validates Kubernetes objects against the schemas of the projects that own them, newer than the
// test bed's v1.20 apiserver: kubernetes-models (Kubernetes' own OpenAPI: core, apps, policy,
// autoscaling, RBAC, admission, CRDs), @kubernetes-models/keda (ScaledObject) and
// @kubernetes-models/prometheus-operator (ServiceMonitor, PodMonitor, PrometheusRule).
//
// stdin: a JSON array of objects. stdout: a JSON array, one {apiVersion, kind, name, errors} per
// object, in order. Exit 1 when any object is invalid or no owner's schema knows its kind.
// Dependencies: `npm ci` here (hack/setup.sh does it). Called by tests/unit/test_object_schemas.py.

import { readFileSync } from "node:fs";

// API groups whose schemas come from a package of their own; every other group, and the core
// group, from kubernetes-models.
const OWNERS = {
  "keda.sh": "@kubernetes-models/keda",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

async function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const path = OWNERS[group] ? `${OWNERS[group]}/${group}/${version}/${kind}`
    : `kubernetes-models/${group ? `${group}/` : ""}${version}/${kind}`;
  try {
    return (await import(path))[kind] ?? null;
  } catch {
    return null;
  }
}

async function check(obj) {
  const { apiVersion = "", kind = "" } = obj;
  const result = { apiVersion, kind, name: obj.metadata?.name ?? "", errors: [] };
  const Model = await modelFor(apiVersion, kind);
  if (!Model) {
    result.errors.push(`no owner's schema for ${apiVersion} ${kind}`);
    return result;
  }
  try {
    new Model(obj).validate();
  } catch (err) {
    result.errors.push(...String(err.message).split("\n").filter(Boolean));
  }
  return result;
}

const objects = JSON.parse(readFileSync(0, "utf8"));
const results = [];
for (const obj of objects) results.push(await check(obj));
process.stdout.write(JSON.stringify(results));
process.exitCode = results.some((r) => r.errors.length) ? 1 : 0;
