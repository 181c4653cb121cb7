"""The process's sockets: the listening main port, client connections and their limits, the
upstream connection pool, the admin port, and the wiring that starts and drains them.

May import `proxy.exchange`, `proxy.observe`, `proxy.core` and `proxy.config`; never `proxy.workers`
or `proxy.tools`.
"""
