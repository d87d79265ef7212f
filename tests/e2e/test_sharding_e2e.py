"""Sharded operators: the two pods of the chart's StatefulSet (`shards=2`), run as
processes with its shard arguments (`--shard auto`) and their pod names, on the real
apiserver. Every VLMDeployment is reconciled by exactly one of them, the one its hash names."""

from __future__ import annotations

import uuid

from kube_helpers import cr, create, get_cr, wait_for
from kubernetes import client

from vlm_operator.runtime.sharding import shard_of
from vlm_testbed.chart import template
from vlm_testbed.controlplane import ready_namespace
from vlm_testbed.operator_process import OperatorProcess


def test_each_vlmdeployment_is_handled_by_its_shard_only(api, cluster):
    ns = ready_namespace(api, f"e2e-solo-{uuid.uuid4().hex[:6]}")
    # three names for each shard (the namespace is random, so the names are picked for it)
    names = []
    for name in (f"s{i}" for i in range(1000)):
        if sum(shard_of(ns, n, 2) == shard_of(ns, name, 2) for n in names) < 3:
            names.append(name)
        if len(names) == 6:
            break
    owners = {name: shard_of(ns, name, 2) for name in names}
    assert sorted(owners.values()) == [0, 0, 0, 1, 1, 1], owners
    (sts,) = [d for d in template("--set", "shards=2") if d["kind"] == "StatefulSet"]
    args = [a for a in sts["spec"]["template"]["spec"]["containers"][0]["args"]
            if a.startswith("--shard")]
    assert sts["spec"]["replicas"] == 2 and len(args) == 2, args
    ops = [OperatorProcess(cluster.kubeconfig, "--standalone", *args, "-n", ns,
                           env={"POD_NAME": f"{sts['metadata']['name']}-{i}"})
           for i in range(2)]
    try:
        for op in ops:
            op.start()
        for name in names:
            create(api, ns, cr(name, replicas=0))
        for name in names:
            wait_for(f"{name} reconciled", lambda n=name: (get_cr(api, ns, n).get("status")
                                                            or {}).get("observedGeneration"),
                     timeout=120)
        for name in names:
            made = [i for i, op in enumerate(ops)
                    if f"{ns}/{name}: Created Deployment {name}" in op.log()]
            assert made == [owners[name]], (name, made)
    except BaseException:
        for op in ops:
            print(op.log()[-3000:])
        raise
    finally:
        for op in ops:
            op.stop()
        client.CoreV1Api(api).delete_namespace(ns)
