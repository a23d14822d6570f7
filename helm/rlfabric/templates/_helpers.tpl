{{/*
Names
*/}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "rlfabric.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource-name prefix. Cut to 30 characters so that the longest derived names
("<fullname>-reference-headless", StatefulSet revision labels "<sts>-<hash>")
stay within the 63-character limit.
*/}}
{{- define "rlfabric.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 30 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 30 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 30 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "name-version" for the helm.sh/chart label. */}}
{{- define "rlfabric.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* All roles, in start-up order. */}}
{{- define "rlfabric.roleNames" -}}
actor reference critic teacher rollout judge reward env coordinator
{{- end }}

{{/* Roles whose replicas are the ranks of one torch.distributed group (rank 0 serves gRPC). */}}
{{- define "rlfabric.isMultiRank" -}}
{{- if has . (list "actor" "critic") }}true{{ end }}
{{- end }}

{{/* Workload name of a role. Args: dict ctx role. */}}
{{- define "rlfabric.roleFullname" -}}
{{- printf "%s-%s" (include "rlfabric.fullname" .ctx) .role }}
{{- end }}

{{/* Headless Service of a StatefulSet role. Args: dict ctx role. */}}
{{- define "rlfabric.headlessName" -}}
{{- printf "%s-%s-headless" (include "rlfabric.fullname" .ctx) .role }}
{{- end }}

{{- define "rlfabric.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rlfabric.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rlfabric.configMapName" -}}
{{- printf "%s-config" (include "rlfabric.fullname" .) }}
{{- end }}

{{/* The Secret holding the bearer token: auth.secretName, or the one the chart creates. */}}
{{- define "rlfabric.authSecretName" -}}
{{- .Values.auth.secretName | default (printf "%s-auth" (include "rlfabric.fullname" .)) }}
{{- end }}

{{/* The Secret holding the environment link's token: auth.env.secretName, or the one the chart creates. */}}
{{- define "rlfabric.envAuthSecretName" -}}
{{- .Values.auth.env.secretName | default (printf "%s-env-auth" (include "rlfabric.fullname" .)) }}
{{- end }}

{{/*
"true" when the environment link gets a token of its own (auth.env): the mesh has one and the run uses an
environment (the chart's env role, roles.env.external, or rollout.multi_turn). The env pod then mounts it
instead of the mesh's token, which authorises every RPC of every service; the rollout and coordinator pods
mount it beside the mesh's.
*/}}
{{- define "rlfabric.envAuth" -}}
{{- if .Values.auth.enabled }}
{{- $rollout := get (.Values.config | default dict) "rollout" | default dict }}
{{- $multiTurn := (get $rollout "multi_turn" | default dict).enable }}
{{- if or (include "rlfabric.roleEnabled" (dict "ctx" . "role" "env")) .Values.roles.env.external $multiTurn }}true{{ end }}
{{- end }}
{{- end }}

{{/* The Secret holding the TLS certificate: tls.secretName, or the one the chart's cert-manager
Certificate writes. */}}
{{- define "rlfabric.tlsSecretName" -}}
{{- if .Values.tls.secretName }}{{ .Values.tls.secretName }}
{{- else if .Values.tls.certManager.enabled }}{{ printf "%s-tls" (include "rlfabric.fullname" .) }}
{{- end }}
{{- end }}

{{- define "rlfabric.dataClaimName" -}}
{{- default (printf "%s-data" (include "rlfabric.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{/*
Labels
*/}}

{{/* Selector labels. Args: dict ctx role (role may be ""). */}}
{{- define "rlfabric.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlfabric.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .role }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/* Standard labels. Args: dict ctx role (role may be ""). */}}
{{- define "rlfabric.labels" -}}
helm.sh/chart: {{ include "rlfabric.chart" .ctx }}
{{ include "rlfabric.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: rlfabric
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{/*
Images and ports
*/}}

{{/* Image reference of a role. Args: dict ctx role. */}}
{{- define "rlfabric.image" -}}
{{- $img := (index .ctx.Values.roles .role).image }}
{{- $repo := default .ctx.Values.image.repository $img.repository }}
{{- $base := default .ctx.Chart.AppVersion .ctx.Values.image.tag }}
{{- $tag := $img.tag }}
{{- if not $tag }}
{{- $tag = ternary (printf "%s-%s" $base $img.variant) $base (ne $img.variant "") }}
{{- end }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* Port that answers grpc.health.v1: the plaintext health port when TLS is on. */}}
{{- define "rlfabric.healthPort" -}}
{{- if .Values.tls.enabled }}{{ int .Values.ports.health }}{{ else }}{{ int .Values.ports.grpc }}{{ end }}
{{- end }}

{{/*
"true" when the role is deployed, else "": roles.<role>.enabled true, or "auto" and the run config
uses the role, as the launchers decide (rlfabric RunConfig.roles_in_use): a critic only for GAE, a
reference only when reference.enable (default true), a KL term reads it and the actor has no LoRA
adapters (with them, the actor's base model is the reference), a teacher only when algorithm.distill.enable,
a judge pool only when judge.model_path is set, an env only when env.enable. An env
given as roles.env.external is never deployed. Args: dict ctx role.
*/}}
{{- define "rlfabric.roleEnabled" -}}
{{- $r := index .ctx.Values.roles .role }}
{{- if and (eq .role "env") $r.external }}
{{- else if eq (toString $r.enabled) "auto" }}
{{- $config := .ctx.Values.config | default dict }}
{{- $algorithm := $config.algorithm | default dict }}
{{- $actor := $config.actor | default dict }}
{{- $reference := $config.reference | default dict }}
{{- if eq .role "critic" }}
{{- if eq (toString ($algorithm.adv_estimator | default "grpo")) "gae" }}true{{ end }}
{{- else if eq .role "env" }}
{{- if (get $config "env" | default dict).enable }}true{{ end }}
{{- else if eq .role "teacher" }}
{{- if ($algorithm.distill | default dict).enable }}true{{ end }}
{{- else if eq .role "judge" }}
{{- if (get $config "judge" | default dict).model_path }}true{{ end }}
{{- else if eq .role "reference" }}
{{- $on := or (not (hasKey $reference "enable")) $reference.enable }}
{{- $lora := $actor.lora | default dict }}
{{- if and $on (or $actor.use_kl_loss $algorithm.use_kl_in_reward) (not (gt (int ($lora.rank | default 0)) 0)) }}true{{ end }}
{{- else }}true{{ end }}
{{- else if $r.enabled }}true{{ end }}
{{- end }}

{{/*
gRPC addresses of a role as a YAML list of "host:port" strings. Args: dict ctx role port.
StatefulSet roles list every replica through the headless Service
(<name>-<i>.<headless>.<ns>.svc); multi-rank roles list rank 0 only; the
coordinator is listed through its Service. Disabled roles give [].
*/}}
{{- define "rlfabric.addresses" -}}
{{- $ctx := .ctx }}
{{- $r := index $ctx.Values.roles .role }}
{{- $ns := $ctx.Release.Namespace }}
{{- $addrs := list }}
{{- if include "rlfabric.roleEnabled" . }}
{{- if eq .role "coordinator" }}
{{- $addrs = append $addrs (printf "%s.%s.svc:%d" (include "rlfabric.roleFullname" .) $ns (int .port)) }}
{{- else }}
{{- $n := int $r.replicas }}
{{- if and (include "rlfabric.isMultiRank" .role) (gt $n 1) }}
{{- $n = 1 }}
{{- end }}
{{- $pod := include "rlfabric.roleFullname" . }}
{{- $svc := include "rlfabric.headlessName" . }}
{{- range $i := until $n }}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc:%d" $pod $i $svc $ns (int $.port)) }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $addrs }}
{{- end }}

{{/*
Run config
*/}}

{{/* The run config: .Values.config plus the chart's cluster/server/trainer/storage/tracing keys. */}}
{{- define "rlfabric.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) }}
{{- $trainer := get $cfg "trainer" | default dict }}
{{- if not (hasKey $trainer "run_dir") }}
{{- $_ := set $trainer "run_dir" (printf "%s/runs/%s" .Values.persistence.mountPath .Release.Name) }}
{{- end }}
{{- $_ := set $cfg "trainer" $trainer }}
{{- $storage := get $cfg "storage" | default dict }}
{{- if not (hasKey $storage "root") }}
{{- $_ := set $storage "root" .Values.persistence.mountPath }}
{{- end }}
{{- $_ := set $cfg "storage" $storage }}
{{- $server := get $cfg "server" | default dict }}
{{- if and (not .Values.tls.enabled) .Values.tls.allowPlaintext }}
{{- $_ := set $server "allow_insecure" true }}
{{- end }}
{{- with .Values.tls }}
{{- if .enabled }}
{{- $_ := set $server "tls" (dict
      "cert_file" (printf "%s/%s" .mountPath .certKey)
      "key_file" (printf "%s/%s" .mountPath .keyKey)
      "ca_file" (printf "%s/%s" .mountPath .caKey)
      "require_client_cert" .mtls) }}
{{- end }}
{{- end }}
{{- with .Values.auth }}
{{- if .enabled }}
{{- $_ := set $server "auth_token_file" (printf "%s/%s" .mountPath .secretKey) }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "server" $server }}
{{- if include "rlfabric.envAuth" . }}
{{- $env := get $cfg "env" | default dict }}
{{- $_ := set $env "auth_token_file" (printf "%s/%s" .Values.auth.env.mountPath .Values.auth.env.secretKey) }}
{{- $_ := set $cfg "env" $env }}
{{- end }}
{{- $tracing := get $cfg "tracing" | default dict }}
{{- if and .Values.tracing.endpoint (not (hasKey $tracing "endpoint")) }}
{{- $_ := set $tracing "endpoint" .Values.tracing.endpoint }}
{{- $_ := set $cfg "tracing" $tracing }}
{{- end }}
{{- $cluster := dict }}
{{- range $role := list "actor" "reference" "critic" "teacher" "rollout" "judge" "reward" "env" }}
{{- $addrs := include "rlfabric.addresses" (dict "ctx" $ "role" $role "port" $.Values.ports.grpc) | fromYamlArray }}
{{- $_ := set $cluster $role $addrs }}
{{- end }}
{{- /* The judge pool's replicas, through its headless Service, are the reward service's judge (never in
cluster.rollout, so no weight sync reaches them). */}}
{{- if $cluster.judge }}
{{- $reward := get $cfg "reward" | default dict }}
{{- $judge := get $reward "judge" | default dict }}
{{- $_ := set $judge "addresses" $cluster.judge }}
{{- $_ := set $reward "judge" $judge }}
{{- $_ := set $cfg "reward" $reward }}
{{- end }}
{{- with .Values.roles.env.external }}
{{- $_ := set $cluster "env" (list .) }}
{{- end }}
{{- $_ := set $cfg "cluster" $cluster }}
{{- /* `kubectl scale statefulset <release>-rollout`: the coordinator finds the rollout pods through their headless
Service (rollout.discovery) and takes them in, or lets them go, at the run's next weight sync. */}}
{{- $rollout := get $cfg "rollout" | default dict }}
{{- if and (include "rlfabric.roleEnabled" (dict "ctx" $ "role" "rollout")) (not (hasKey $rollout "discovery")) }}
{{- $headless := include "rlfabric.headlessName" (dict "ctx" $ "role" "rollout") }}
{{- $_ := set $rollout "discovery" (printf "%s.%s.svc:%d" $headless .Release.Namespace (int .Values.ports.grpc)) }}
{{- $_ := set $cfg "rollout" $rollout }}
{{- end }}
{{- /*
Helm keeps numbers as float64 and writes 1e-6 as "1e-06" and 1000000 as "1e+06",
which YAML 1.1 loaders (PyYAML) read as strings: give such mantissas a ".0".
*/}}
{{- regexReplaceAll "(?m)([:-] -?[0-9]+)(e[-+][0-9]+)$" (toYaml $cfg) "${1}.0${2}" }}
{{- end }}

{{/*
Pod template
*/}}

{{/* The node pool of a role: roles.<role>.pool, else the pool the run config gives the role
(config.<role>.pool, a key of config.resource_pools), "" for none. Args: dict ctx role. */}}
{{- define "rlfabric.poolName" -}}
{{- $r := index .ctx.Values.roles .role }}
{{- $section := index (.ctx.Values.config | default dict) .role | default dict }}
{{- $r.pool | default ($section.pool | default "") }}
{{- end }}

{{/* The run-config resource pool of a role (config.<role>.pool), "" for none. Args: dict ctx role. */}}
{{- define "rlfabric.resourcePool" -}}
{{- $section := index (.ctx.Values.config | default dict) .role | default dict }}
{{- $section.pool | default "" }}
{{- end }}

{{/* Nodes the role's run-config pool spans (config.resource_pools.<pool>.nodes); 1 without a pool. Args: dict ctx role. */}}
{{- define "rlfabric.poolNodes" -}}
{{- $pools := (.ctx.Values.config | default dict).resource_pools | default dict }}
{{- $spec := index $pools (include "rlfabric.resourcePool" .) | default dict }}
{{- int ($spec.nodes | default 1) }}
{{- end }}

{{/* Checks a role's settings that the schema cannot express. Args: dict ctx role. */}}
{{- define "rlfabric.validateRole" -}}
{{- $r := index .ctx.Values.roles .role }}
{{- $pool := include "rlfabric.poolName" . }}
{{- if and $pool (not (hasKey .ctx.Values.pools $pool)) }}
{{- if $r.pool }}
{{- fail (printf "roles.%s.pool: %q is not a key of .Values.pools" .role $pool) }}
{{- else }}
{{- fail (printf "config.%s.pool: %q is not a key of .Values.pools: add it there (its nodeSelector, tolerations and resources), or set roles.%s.pool" .role $pool .role) }}
{{- end }}
{{- end }}
{{- with $r.colocateWith }}
{{- if or (eq . $.role) (not (hasKey $.ctx.Values.roles .)) }}
{{- fail (printf "roles.%s.colocateWith: %q must name another role" $.role .) }}
{{- end }}
{{- if not (include "rlfabric.roleEnabled" (dict "ctx" $.ctx "role" .)) }}
{{- fail (printf "roles.%s.colocateWith: role %q is not enabled" $.role .) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Scheduling fields (nodeSelector, tolerations, affinity) of a role. Args: dict ctx role. */}}
{{- define "rlfabric.scheduling" -}}
{{- $r := index .ctx.Values.roles .role }}
{{- $pool := index .ctx.Values.pools (include "rlfabric.poolName" .) | default dict }}
{{- $nodeSelector := merge (deepCopy ($r.nodeSelector | default dict)) ($pool.nodeSelector | default dict) }}
{{- $tolerations := concat ($pool.tolerations | default list) ($r.tolerations | default list) }}
{{- $affinity := deepCopy (ternary $r.affinity ($pool.affinity | default dict) (not (empty $r.affinity))) }}
{{- with $r.colocateWith }}
{{- $term := dict
      "labelSelector" (dict "matchLabels" (include "rlfabric.selectorLabels" (dict "ctx" $.ctx "role" .) | fromYaml))
      "topologyKey" "kubernetes.io/hostname" }}
{{- $podAffinity := get $affinity "podAffinity" | default dict }}
{{- $required := get $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $_ := set $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" (append $required $term) }}
{{- $_ := set $affinity "podAffinity" $podAffinity }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- /* A run-config pool of N nodes (config.resource_pools.<pool>.nodes, as Ray's STRICT_SPREAD placement group):
its pods spread evenly over distinct nodes, and over at least N of them (minDomains: with fewer schedulable
nodes, a pod that would share a node with another of the pool stays Pending) */}}
{{- $nodes := int (include "rlfabric.poolNodes" .) }}
{{- if gt $nodes 1 }}
topologySpreadConstraints:
  - maxSkew: 1
    minDomains: {{ $nodes }}
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: DoNotSchedule
    labelSelector:
      matchLabels:
        {{- include "rlfabric.selectorLabels" (dict "ctx" .ctx "role" "") | nindent 8 }}
        rlfabric.io/resource-pool: {{ include "rlfabric.resourcePool" . }}
{{- end }}
{{- end }}

{{/* GPUs per pod of a role: roles.<role>.gpus, or for auto one per pod (a rank, a replica, as the local
launcher gives each; a rollout or judge replica config.<role>.tensor_parallel_size), none when the role's run-config
pool has no GPUs. Args: dict ctx role. */}}
{{- define "rlfabric.gpus" -}}
{{- $r := index .ctx.Values.roles .role }}
{{- if eq (toString $r.gpus) "auto" }}
{{- $config := .ctx.Values.config | default dict }}
{{- $section := index $config .role | default dict }}
{{- $runPool := index ($config.resource_pools | default dict) ($section.pool | default "") }}
{{- $perPod := ternary (int ($section.tensor_parallel_size | default 1)) 1 (has .role (list "rollout" "judge")) }}
{{- if and $runPool (not (gt (int ($runPool.gpus | default 0)) 0)) (empty $runPool.devices) }}0{{ else }}{{ $perPod }}{{ end }}
{{- else }}
{{- int $r.gpus }}
{{- end }}
{{- end }}

{{/* Container resources of a role (its pool's fill what the role leaves out), with the GPU limit from
rlfabric.gpus. Args: dict ctx role. */}}
{{- define "rlfabric.resources" -}}
{{- $r := index .ctx.Values.roles .role }}
{{- $pool := index .ctx.Values.pools (include "rlfabric.poolName" .) | default dict }}
{{- $res := merge (deepCopy ($r.resources | default dict)) (deepCopy ($pool.resources | default dict)) }}
{{- $gpus := int (include "rlfabric.gpus" .) }}
{{- if gt $gpus 0 }}
{{- $limits := get $res "limits" | default dict }}
{{- $_ := set $limits .ctx.Values.gpuResourceName $gpus }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Native gRPC probe against grpc.health.v1. Args: dict ctx service settings. */}}
{{- define "rlfabric.grpcProbe" -}}
grpc:
  port: {{ include "rlfabric.healthPort" .ctx }}
  service: {{ .service }}
{{ toYaml .settings }}
{{- end }}

{{/* Pod template of a role. Args: dict ctx role. */}}
{{- define "rlfabric.podTemplate" -}}
{{- $ctx := .ctx }}
{{- $role := .role }}
{{- $r := index $ctx.Values.roles $role }}
{{- $multiRank := include "rlfabric.isMultiRank" $role }}
{{- $ports := $ctx.Values.ports -}}
metadata:
  labels:
    {{- include "rlfabric.labels" . | nindent 4 }}
    {{- with include "rlfabric.resourcePool" . }}
    rlfabric.io/resource-pool: {{ . }}
    {{- end }}
    {{- with $r.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "rlfabric.config" $ctx | sha256sum }}
    {{- with $r.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "rlfabric.serviceAccountName" $ctx }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  {{- with $ctx.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $ctx.Values.podSecurityContext | nindent 4 }}
  {{- with $r.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  terminationGracePeriodSeconds: {{ int $r.terminationGracePeriodSeconds }}
  {{- with include "rlfabric.scheduling" . | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- if and $r.mountData (include "rlfabric.waitsForStage" $ctx) }}
  initContainers:
    {{- include "rlfabric.stageWait" . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ $role }}
      image: {{ include "rlfabric.image" . | quote }}
      imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
      command: ["rlfabric"]
      args:
        - serve
        - {{ $role }}
        - --config
        - {{ $ctx.Values.configPath }}
        - --host
        - 0.0.0.0
        - --port
        - {{ int $ports.grpc | quote }}
        - --metrics-port
        - {{ int $ports.metrics | quote }}
        {{- if $ctx.Values.tls.enabled }}
        - --health-port
        - {{ int $ports.health | quote }}
        {{- end }}
        {{- if and $multiRank (gt (int $r.replicas) 1) }}
        - {{ printf "%s.world_size=%d" $role (int $r.replicas) | quote }}
        {{- end }}
        # Peers reach this pod's weight-sync stores at its IP, not at the bind address.
        - weight_sync.host=$(POD_IP)
        {{- range $r.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: HOME
          value: /tmp
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- if $multiRank }}
        - name: MASTER_ADDR
          value: {{ printf "%s-0.%s.%s.svc" (include "rlfabric.roleFullname" .) (include "rlfabric.headlessName" .) $ctx.Release.Namespace }}
        - name: MASTER_PORT
          value: {{ int $ports.rendezvous | quote }}
        - name: WORLD_SIZE
          value: {{ int $r.replicas | quote }}
        - name: RANK
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
        {{- end }}
        {{- with $ctx.Values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        {{- with $r.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ int $ports.grpc }}
          protocol: TCP
        {{- if $ctx.Values.tls.enabled }}
        - name: health
          containerPort: {{ int $ports.health }}
          protocol: TCP
        {{- end }}
        - name: metrics
          containerPort: {{ int $ports.metrics }}
          protocol: TCP
        {{- if $multiRank }}
        - name: rendezvous
          containerPort: {{ int $ports.rendezvous }}
          protocol: TCP
        {{- end }}
      startupProbe:
        {{- include "rlfabric.grpcProbe" (dict "ctx" $ctx "service" "liveness" "settings" $ctx.Values.probes.startup) | nindent 8 }}
      livenessProbe:
        {{- include "rlfabric.grpcProbe" (dict "ctx" $ctx "service" "liveness" "settings" $ctx.Values.probes.liveness) | nindent 8 }}
      readinessProbe:
        {{- include "rlfabric.grpcProbe" (dict "ctx" $ctx "service" "readiness" "settings" $ctx.Values.probes.readiness) | nindent 8 }}
      resources:
        {{- include "rlfabric.resources" . | nindent 8 }}
      securityContext:
        {{- toYaml $ctx.Values.containerSecurityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: {{ $ctx.Values.configPath }}
          subPath: config.yaml
          readOnly: true
        - name: tmp
          mountPath: /tmp
        {{- if $r.shmSize }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
        {{- if $r.mountData }}
        - name: data
          mountPath: {{ $ctx.Values.persistence.mountPath }}
        {{- end }}
        {{- if $ctx.Values.tls.enabled }}
        - name: tls
          mountPath: {{ $ctx.Values.tls.mountPath }}
          readOnly: true
        {{- end }}
        {{- if and $ctx.Values.auth.enabled (ne $role "env") }}
        - name: auth
          mountPath: {{ $ctx.Values.auth.mountPath }}
          readOnly: true
        {{- end }}
        {{- if and (include "rlfabric.envAuth" $ctx) (has $role (list "env" "rollout" "coordinator")) }}
        - name: env-auth
          mountPath: {{ $ctx.Values.auth.env.mountPath }}
          readOnly: true
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "rlfabric.configMapName" $ctx }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ $ctx.Values.tmpSizeLimit }}
    {{- with $r.shmSize }}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ . }}
    {{- end }}
    {{- if $r.mountData }}
    - name: data
      {{- if $ctx.Values.persistence.enabled }}
      persistentVolumeClaim:
        claimName: {{ include "rlfabric.dataClaimName" $ctx }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- end }}
    {{- if $ctx.Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ include "rlfabric.tlsSecretName" $ctx }}
        defaultMode: 288  # 0440
    {{- end }}
    {{- if and $ctx.Values.auth.enabled (ne $role "env") }}
    - name: auth
      secret:
        secretName: {{ include "rlfabric.authSecretName" $ctx }}
        defaultMode: 288  # 0440
    {{- end }}
    {{- if and (include "rlfabric.envAuth" $ctx) (has $role (list "env" "rollout" "coordinator")) }}
    - name: env-auth
      secret:
        secretName: {{ include "rlfabric.envAuthSecretName" $ctx }}
        defaultMode: 288  # 0440
    {{- end }}
{{- end }}

{{/* Release-wide checks the schema cannot express. */}}
{{- define "rlfabric.validate" -}}
{{- $reward := get (.Values.config | default dict) "reward" | default dict }}
{{- if and (get $reward "model_path") (eq .Values.roles.reward.image.variant "light") }}
{{- fail "config.reward.model_path: a reward model runs on torch, which the light image lacks: set roles.reward.image.variant: train" }}
{{- end }}
{{- if and (get (get $reward "judge" | default dict) "addresses") (include "rlfabric.roleEnabled" (dict "ctx" . "role" "judge")) }}
{{- fail "config.reward.judge.addresses with config.judge.model_path: the chart deploys the judge pool and writes its addresses there; give config.judge.model_path (the chart's pool) or config.reward.judge.addresses (judge services of your own), not both" }}
{{- end }}
{{- with .Values.roles.env.external }}
{{- if not (regexMatch "^[^:/ ]+:[0-9]+$" .) }}
{{- fail (printf "roles.env.external: %q is not host:port" .) }}
{{- end }}
{{- end }}
{{- if not .Values.persistence.enabled }}
{{- fail "persistence.enabled=false gives every pod an emptyDir of its own, but the coordinator, actor and critic write one run folder together (initial weights, checkpoints, final model): keep persistence on (ReadWriteMany, or ReadWriteOnce when every pod runs on one node)" }}
{{- end }}
{{- range $role := list "coordinator" "actor" "critic" }}
{{- if and (include "rlfabric.roleEnabled" (dict "ctx" $ "role" $role)) (not (index $.Values.roles $role).mountData) }}
{{- fail (printf "roles.%s.mountData=false: the %s writes its part of every checkpoint into the run folder on the data volume, which it must mount" $role $role) }}
{{- end }}
{{- end }}
{{- /* weight_sync.transport: each pod gets GPUs of its own from the device plugin, so the chart can tell a
role on CPU (no GPUs), not whether two pods share a GPU (time-slicing): auto decides that at run start from
the GPU UUIDs the services report. A forced nccl with the actor or the rollout on CPU cannot run. */}}
{{- $config := .Values.config | default dict }}
{{- if eq (toString (get (get $config "weight_sync" | default dict) "transport")) "nccl" }}
{{- $sglang := eq (toString (get (get $config "rollout" | default dict) "engine")) "sglang" }}
{{- range $role := list "actor" "rollout" }}
{{- if and (not (and $sglang (eq $role "rollout"))) (eq (int (include "rlfabric.gpus" (dict "ctx" $ "role" $role))) 0) }}
{{- fail (printf "config.weight_sync.transport nccl needs the actor and the rollout on GPUs, and roles.%s.gpus gives the %s pods none: set config.weight_sync.transport to auto (it picks gloo then), gloo or grpc" $role $role) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* A pool of N nodes needs at least N pods (Ray refuses it too: a node of the pool would hold nothing). */}}
{{- range $name, $pool := ($config.resource_pools | default dict) }}
{{- $nodes := int ($pool.nodes | default 1) }}
{{- $pods := 0 }}
{{- $members := list }}
{{- range $role := list "actor" "reference" "critic" "teacher" "rollout" "judge" "reward" "env" }}
{{- $args := dict "ctx" $ "role" $role }}
{{- if and (eq (include "rlfabric.resourcePool" $args) $name) (include "rlfabric.roleEnabled" $args) }}
{{- $replicas := int (index $.Values.roles $role).replicas }}
{{- $pods = add $pods $replicas }}
{{- $members = append $members (printf "%s: %d" $role $replicas) }}
{{- end }}
{{- end }}
{{- if and (gt $nodes 1) (gt $pods 0) (lt $pods $nodes) }}
{{- fail (printf "config.resource_pools.%s.nodes %d: the pool has %d pod(s) (%s) and each of its nodes runs at least one: lower nodes, or add pods (roles.<role>.replicas, config.<role>.pool)" $name $nodes $pods (join ", " $members)) }}
{{- end }}
{{- end }}
{{- if and .Values.tls.mtls (not .Values.tls.enabled) }}
{{- fail "tls.mtls requires tls.enabled" }}
{{- end }}
{{- if and .Values.tls.enabled (not (include "rlfabric.tlsSecretName" .)) }}
{{- fail "tls.enabled requires tls.secretName (a Secret with the certificate, key and CA) or tls.certManager.enabled" }}
{{- end }}
{{- if and .Values.tls.certManager.enabled (not .Values.tls.certManager.issuerRef.name) }}
{{- fail "tls.certManager.enabled requires tls.certManager.issuerRef.name (a cert-manager Issuer or ClusterIssuer)" }}
{{- end }}
{{- if and .Values.tls.enabled (eq (int .Values.ports.health) (int .Values.ports.grpc)) }}
{{- fail "ports.health must differ from ports.grpc when TLS is on" }}
{{- end }}
{{- end }}

{{/*
Staging (stage-job.yaml)
*/}}

{{/* The stage Job's marker on the data volume, written when the model and data are there: named by what
was staged, so a release that stages something else waits for its own. */}}
{{- define "rlfabric.stageMarker" -}}
{{- $config := .Values.config | default dict }}
{{- $what := list .Values.stage.model .Values.stage.data ($config.model | default dict).path ($config.data | default dict).train_files }}
{{- printf "%s/.rlfabric-staged/%s" .Values.persistence.mountPath (toJson $what | sha256sum | trunc 16) }}
{{- end }}

{{/* "true" when pods that mount the data volume wait for the stage Job. */}}
{{- define "rlfabric.waitsForStage" -}}
{{- if and .Values.stage.enabled (or .Values.stage.model .Values.stage.data) }}true{{ end }}
{{- end }}

{{/* The init container of a pod that mounts the data volume: waits for the stage Job's marker. Args: dict ctx role. */}}
{{- define "rlfabric.stageWait" -}}
- name: wait-for-stage
  image: {{ include "rlfabric.image" . | quote }}
  imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
  command: ["sh", "-c"]
  args:
    - {{ printf "until [ -e %s ]; do echo waiting for the stage Job to put the model and data on the volume; sleep 2; done" (include "rlfabric.stageMarker" .ctx | squote) | quote }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
  securityContext:
    {{- toYaml .ctx.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    - name: data
      mountPath: {{ .ctx.Values.persistence.mountPath }}
{{- end }}
