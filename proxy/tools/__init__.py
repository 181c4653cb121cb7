"""Tools that are not the sidecar: the fault-injecting fake upstream, the demo, the benchmark, and
`streamwarden check`. They may import anything of the package; nothing outside `proxy.tools` and
`proxy.cli` imports them, so the runtime never loads a tool.
"""
