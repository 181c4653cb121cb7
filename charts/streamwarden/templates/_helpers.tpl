{{/* The image the proxy runs: image.repository:image.tag, the tag defaulting to the chart's appVersion. */}}
{{- define "streamwarden.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The streamwarden container beside a backend; called with (dict "root" $ "backend" $backend). */}}
{{- define "streamwarden.sidecar" -}}
{{- $root := .root -}}
{{- $backend := .backend -}}
name: streamwarden
image: {{ include "streamwarden.image" $root | quote }}
args: ["serve"]
env:
  - name: STREAMWARDEN_UPSTREAM
    value: {{ printf "http://127.0.0.1:%v" $backend.port | quote }}
  - name: STREAMWARDEN_HEALTH_PATH
    value: {{ $backend.healthPath | quote }}
  - name: STREAMWARDEN_DRAIN_TIMEOUT
    value: {{ $root.Values.sidecar.drainTimeout | toString | quote }}
  - name: STREAMWARDEN_LOG_FORMAT
    value: {{ $root.Values.sidecar.logFormat | quote }}
  {{- with $root.Values.sidecar.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
ports:
  - name: http
    containerPort: 8080
    protocol: TCP
  - name: metrics
    containerPort: 9464
    protocol: TCP
readinessProbe:
  httpGet:
    path: /readyz
    port: metrics
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
lifecycle:
  preStop:
    exec:
      command: ["sleep", "5"]
resources:
  {{- toYaml $backend.sidecarResources | nindent 2 }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
  seccompProfile:
    type: RuntimeDefault
volumeMounts:
  - name: tmp
    mountPath: /tmp
{{- end -}}
