"""One request through the proxy: the lifecycle's only driver.

Reads the client's request, forwards it, pumps the upstream's answer through the core's guard or
body judge, and turns socket facts (a cut, a stall, a client that left, shutdown) into lifecycle
events whose answers it carries out; cancel hooks and drains of abandoned work live here too.
May import `proxy.core`, `proxy.observe` and `proxy.config`; never `proxy.server`, `proxy.workers`
or `proxy.tools`.
"""
