{{/*
Names. fullname is at most 48 characters so that "<fullname>-headless" and
the StatefulSet's pod names stay valid DNS labels (63).
*/}}
{{- define "prefixstore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefixstore.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "prefixstore.headless" -}}
{{- printf "%s-headless" (include "prefixstore.fullname" .) }}
{{- end }}

{{- define "prefixstore.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "prefixstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "prefixstore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "prefixstore.labels" -}}
helm.sh/chart: {{ include "prefixstore.chart" . }}
{{ include "prefixstore.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: prefixstore
{{- end }}

{{- define "prefixstore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "prefixstore.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The node image. No registry carries it: the operator builds and pushes it, and names it. */}}
{{- define "prefixstore.image" -}}
{{- if not .Values.image.repository }}
{{- fail (printf "image.repository: no public registry carries the prefixstore image; build it from the repository's Dockerfile and push it where the cluster pulls from (docker build -t REGISTRY/prefixstore:%s . && docker push REGISTRY/prefixstore:%s), then set image.repository=REGISTRY/prefixstore" .Chart.AppVersion .Chart.AppVersion) }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "prefixstore.scheme" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end }}
{{- end }}

{{/* The DNS suffix every pod of the StatefulSet gets under the headless Service. */}}
{{- define "prefixstore.podDomain" -}}
{{- printf "%s.%s.svc.%s" (include "prefixstore.headless" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "prefixstore.peersDns" -}}
{{- printf "%s:%d" (include "prefixstore.podDomain" .) (int .Values.config.port) }}
{{- end }}

{{/* Whether the store runs with a tenants file, and the Secret holding it. */}}
{{- define "prefixstore.authEnabled" -}}
{{- if or .Values.auth.existingSecret .Values.auth.tenants }}true{{ end }}
{{- end }}

{{- define "prefixstore.authSecretName" -}}
{{- default (printf "%s-tenants" (include "prefixstore.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The key of the auth Secret holding the cluster token (replica pushes), or nothing. */}}
{{- define "prefixstore.clusterTokenKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretClusterTokenKey }}{{ else if .Values.auth.clusterToken }}cluster-token{{ end }}
{{- end }}

{{- define "prefixstore.authSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}tenants.toml{{ end }}
{{- end }}

{{/* A size value as the operator wrote it: "4GiB" stays, a number prints as whole bytes (not 4.294967296e+09). */}}
{{- define "prefixstore.size" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ int64 . }} bytes{{ end }}
{{- end }}

{{/* Paths inside the pod. */}}
{{- define "prefixstore.configDir" -}}/etc/prefixstore{{- end }}
{{- define "prefixstore.tenantsDir" -}}/etc/prefixstore/tenants{{- end }}
{{- define "prefixstore.tlsDir" -}}/etc/prefixstore/tls{{- end }}
{{- define "prefixstore.dataDir" -}}/var/lib/prefixstore{{- end }}

{{/*
The store's TOML config file. Every key of .Values.config is written as is
(toJson renders strings, numbers and booleans as valid TOML values, and keeps
large integers out of exponent notation), then the knobs the chart owns.
node_url is per pod and comes from the environment (PREFIXSTORE_NODE_URL).
*/}}
{{- define "prefixstore.storeToml" -}}
# prefixstore StoreConfig, rendered by the {{ include "prefixstore.chart" . }} chart.
# Every key is a field of StoreConfig (store/config.py); `prefixstore serve --help` documents each.
{{- range $key, $value := .Values.config }}
{{ $key }} = {{ $value | toJson }}
{{- end }}
# Set by the chart:
host = "0.0.0.0"
peers_dns = {{ include "prefixstore.peersDns" . | toJson }}
data_dir = {{ printf "%s/lmdb" (include "prefixstore.dataDir" .) | toJson }}
{{- if include "prefixstore.authEnabled" . }}
tenants_file = {{ printf "%s/%s" (include "prefixstore.tenantsDir" .) (include "prefixstore.authSecretKey" .) | toJson }}
{{- with include "prefixstore.clusterTokenKey" . }}
cluster_token_file = {{ printf "%s/%s" (include "prefixstore.tenantsDir" $) . | toJson }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
tls_cert_file = {{ printf "%s/tls.crt" (include "prefixstore.tlsDir" .) | toJson }}
tls_key_file = {{ printf "%s/tls.key" (include "prefixstore.tlsDir" .) | toJson }}
{{- if .Values.tls.mutual }}
tls_client_ca_file = {{ printf "%s/ca.crt" (include "prefixstore.tlsDir" .) | toJson }}
{{- end }}
{{- end }}
{{- end }}

{{/* The tenants file (TOML) made from .Values.auth when no existingSecret is named. */}}
{{- define "prefixstore.tenantsToml" -}}
# prefixstore tenants file (store/tenants.py): sha256 digests of bearer tokens, never the tokens.
{{- with .Values.auth.admin_token_sha256 }}
admin_token_sha256 = {{ . | toJson }}
{{- end }}
{{- with .Values.auth.clusterToken }}
cluster_token_sha256 = {{ sha256sum . | toJson }}
{{- end }}
{{- range $name, $spec := .Values.auth.tenants }}

[tenants.{{ $name | toJson }}]
token_sha256 = {{ $spec.token_sha256 | toJson }}
{{- if hasKey $spec "quota_bytes" }}
quota_bytes = {{ $spec.quota_bytes | toJson }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A probe handler: HTTP(S) GET of a path (/healthz: liveness; /readyz: readiness
and startup), or the TCP port under mutual TLS (the kubelet has no client
certificate). Called with (list . "/path").
*/}}
{{- define "prefixstore.probeHandler" -}}
{{- $ := index . 0 }}
{{- if and $.Values.tls.enabled $.Values.tls.mutual }}
tcpSocket:
  port: http
{{- else }}
httpGet:
  path: {{ index . 1 }}
  port: http
  scheme: {{ include "prefixstore.scheme" $ | upper }}
{{- end }}
{{- end }}

{{/*
Label matchers that pick this release's series in PromQL: metrics.selector when given (a
Prometheus that scrapes the nodes itself, without prometheus-operator: its scrape job), else the
ServiceMonitor's job (named after the client Service) and the release's namespace.
*/}}
{{- define "prefixstore.promSelector" -}}
{{- if .Values.metrics.selector }}{{ .Values.metrics.selector }}
{{- else }}job="{{ include "prefixstore.fullname" . }}", namespace="{{ .Release.Namespace }}"
{{- end }}
{{- end }}

{{/*
Bytes of a StoreConfig size, as StoreConfig reads it (store/config.py): an
integer, or a number with a unit, case-insensitive (64KiB, 4GiB, 1.5GB, 65536).
Called with (list "knob.name" value); an unreadable value fails naming the knob.
*/}}
{{- define "prefixstore.sizeBytes" -}}
{{- $name := index . 0 }}{{- $value := index . 1 }}
{{- if not (kindIs "string" $value) }}{{ printf "%.0f" (float64 $value) }}
{{- else }}
{{- $units := dict "" 1.0 "b" 1.0 "k" 1e3 "kb" 1e3 "ki" 1024.0 "kib" 1024.0 "m" 1e6 "mb" 1e6 "mi" 1048576.0 "mib" 1048576.0 "g" 1e9 "gb" 1e9 "gi" 1073741824.0 "gib" 1073741824.0 "t" 1e12 "tb" 1e12 "ti" 1099511627776.0 "tib" 1099511627776.0 }}
{{- $text := trim $value }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $text }}
{{- $unit := trimPrefix $number $text | trim | lower }}
{{- if or (not $number) (not (hasKey $units $unit)) }}
{{- fail (printf "%s: %q is not a size (examples: 65536, 64KiB, 4GiB)" $name $value) }}
{{- end }}
{{- printf "%.0f" (mulf (float64 $number) (get $units $unit)) }}
{{- end }}
{{- end }}

{{/*
Bytes of a Kubernetes quantity (2Gi, 2048Mi, 2G, 2e9, 2147483648; suffixes are
case-sensitive, as Kubernetes reads them). Called with (list "value.name" value).
*/}}
{{- define "prefixstore.quantityBytes" -}}
{{- $name := index . 0 }}{{- $value := index . 1 }}
{{- if not (kindIs "string" $value) }}{{ printf "%.0f" (float64 $value) }}
{{- else if regexMatch "^[0-9]+(\\.[0-9]+)?([eE][0-9]+)?$" $value }}{{ printf "%.0f" (float64 $value) }}
{{- else }}
{{- $units := dict "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $value }}
{{- $unit := trimPrefix $number $value }}
{{- if or (not $number) (not (hasKey $units $unit)) }}
{{- fail (printf "%s: %q is not a quantity this chart can read (examples: 2Gi, 2048Mi, 2G)" $name $value) }}
{{- end }}
{{- printf "%.0f" (mulf (float64 $number) (get $units $unit)) }}
{{- end }}
{{- end }}

{{/*
The ServiceMonitor's tlsConfig when the store serves https. The certificate
names the client Service (values.yaml, tls), not the pod IPs
Prometheus scrapes, so serverName is that name unless given; the CA is the TLS
Secret's ca.crt unless a ca (or caFile) is given. Under mutual TLS the scrape
needs a client certificate the chart cannot invent: refused without one.
*/}}
{{- define "prefixstore.scrapeTlsConfig" -}}
{{- $given := deepCopy (default dict .Values.metrics.serviceMonitor.tlsConfig) }}
{{- $defaults := dict "serverName" (printf "%s.%s.svc" (include "prefixstore.fullname" .) .Release.Namespace) }}
{{- if not (or (hasKey $given "ca") (hasKey $given "caFile") (hasKey $given "insecureSkipVerify")) }}
{{- $_ := set $defaults "ca" (dict "secret" (dict "name" .Values.tls.secretName "key" "ca.crt")) }}
{{- end }}
{{- if and .Values.tls.mutual (not (or (and (hasKey $given "cert") (hasKey $given "keySecret")) (and (hasKey $given "certFile") (hasKey $given "keyFile")))) }}
{{- fail "metrics.serviceMonitor.tlsConfig: tls.mutual makes every client, Prometheus included, present a certificate from the CA: set cert and keySecret (or certFile and keyFile) for the scrape, else every scrape fails and PrefixstoreNodeDown fires" }}
{{- end }}
{{- toYaml (merge $given $defaults) }}
{{- end }}

{{/* Whether the NetworkPolicy renders: on (networkPolicy.enabled) once a selector names the engines. */}}
{{- define "prefixstore.networkPolicyOn" -}}
{{- if and .Values.networkPolicy.enabled (or .Values.networkPolicy.engines.podSelector .Values.networkPolicy.engines.namespaceSelector) }}true{{ end }}
{{- end }}

{{/*
The default spread of the pods over Kubernetes nodes (podSpread), when topologySpreadConstraints
is not given: a machine lost then costs one store node, about 1/N of the cache, not all of it.
*/}}
{{- define "prefixstore.topologySpread" -}}
{{- if .Values.topologySpreadConstraints }}
{{- toYaml .Values.topologySpreadConstraints }}
{{- else if .Values.podSpread.enabled }}
- maxSkew: 1
  topologyKey: {{ .Values.podSpread.topologyKey }}
  whenUnsatisfiable: {{ .Values.podSpread.whenUnsatisfiable }}
  labelSelector:
    matchLabels:
      {{- include "prefixstore.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}
