{{- define "vlm-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vlm-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "vlm-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vlm-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vlm-operator.labels" -}}
{{ include "vlm-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: vlm-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "vlm-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vlm-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "vlm-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
What the operator does inside a watched namespace, read off the code:
- vlmdeployments: kopf lists/watches them and patches finalizers and its progress annotations
  (log watching keeps its restart budget in an annotation too); k8s/kube.py reads them, patches
  /status, and the Builtin autoscaler writes replicas through /scale (patch).
- vlmdeployments/finalizers (update): children carry an ownerReference with
  blockOwnerDeletion: true, which the OwnerReferencesPermissionEnforcement admission plugin
  (OpenShift's default) only lets a client set that may update the owner's finalizers.
- deployments, services, poddisruptionbudgets, persistentvolumeclaims: kopf watches the managed
  ones; k8s/kube.py reads them and server-side applies them (patch; create when missing). Deletion
  is left to the garbage collector through ownerReferences.
- pods: kopf watches; k8s/kube.py lists; log watching streams pods/log, writes each pod's resume
  mark annotation (patch) and reads a pod that does not run after 10 minutes without an event
  (get); a remediation or a scale-down deletes a pod, or relabels it out of the Service first
  (patch).
- events: k8s/kube.py and kopf post Events (create).
- horizontalpodautoscalers, scaledobjects: every reconcile deletes the one a VLMDeployment does
  not want (a 404 when there is none), so delete is always granted; the rest only with
  rbac.hpa / rbac.keda.
- inferencepools (only with rbac.inferencePools): the InferencePool of spec.gateway.inferencePool
  is read, server-side applied (patch; create when missing) and deleted once the spec no longer
  asks for it; the operator learns whether the cluster serves them from discovery.
- kopfpeerings: kopf's peering heartbeats (patch) and runner.py creates the object.
- secrets (get), only with policy.secretLabel: the operator reads the labels of the Secrets a
  VLMDeployment references (metadata only, never the data).
*/}}
{{- define "vlm-operator.namespacedRules" -}}
- apiGroups: ["serving.vlm-operator.dev"]
  resources: ["vlmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.vlm-operator.dev"]
  resources: ["vlmdeployments/status", "vlmdeployments/scale"]
  verbs: ["get", "patch"]
- apiGroups: ["serving.vlm-operator.dev"]
  resources: ["vlmdeployments/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["services", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.policy.secretLabel }}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}
{{- if .Values.rbac.hpa }}
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.keda }}
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.inferencePools }}
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if and .Values.watchNamespaces (not .Values.peering.standalone) }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch", "create"]
{{- end }}
{{- end -}}

{{/*
Cluster-scoped reads, needed in every mode:
- customresourcedefinitions: kopf scans and watches them to find its resources.
- rbac.gpuCapacity: the Builtin autoscaler lists Nodes and all Pods (every namespace: GPUs
  requested by anyone's pods are not free) and PriorityClasses, to cap scale-ups by free GPUs;
  surge replacements ask the same budget; Nodes are watched for drains (cordoned, or tainted by
  the cluster autoscaler or Karpenter), so a drain is noticed within a second.
- namespaces (namespaced mode only): kopf lists/watches them to start per-namespace watches.
- clusterkopfpeerings (cluster-wide mode only): kopf's peering object.
*/}}
{{- define "vlm-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- if .Values.rbac.gpuCapacity }}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
{{- end }}
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["list"]
{{- end }}
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- else if not .Values.peering.standalone }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch", "create"]
{{- end }}
{{- end -}}

{{/*
"vlm-operator.eventsIn": how many times a counter went up in the last `w`. The operator creates a
labelled counter at its first increment, so a new series starts at 1 and increase() alone never
counts that first event (a restart budget spent once would never alert): a series younger than
`w` counts with its whole value, an older one with its increase.
*/}}
{{- define "vlm-operator.eventsIn" -}}
(({{ .s }} unless {{ .s }} offset {{ .w }}) or increase({{ .s }}[{{ .w }}]))
{{- end }}
