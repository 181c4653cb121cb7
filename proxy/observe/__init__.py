"""What the proxy tells its operator: the books (one place that counts, logs and traces an
exchange exactly once), the Prometheus metrics, OpenTelemetry tracing and the structured logs.
May import `proxy.core` and `proxy.config`; nothing of the I/O shell.
"""
