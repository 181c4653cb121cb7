"""`serve --workers N`: the supervisor, its SO_REUSEPORT workers, the model labels they share, and
the CPU count `auto` resolves to. May import `proxy.server` and everything below it; never `proxy.tools`.
"""
