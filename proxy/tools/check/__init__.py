"""`streamwarden check --upstream URL`: which failure modes a backend really shows, and the flags it needs.

A bounded set of small probe requests, one at a time, against a live backend; nothing but the probes is
sent and nothing on the backend is changed. Modules: ``options`` (the command's arguments), ``requests``
(what is asked), ``client`` (the one connection; SSE read with the proxy's own reader), ``verdicts``
(the sans-IO rules), ``probes`` and ``abandon`` (the probes), ``backends`` (their metrics), ``report``
(findings, the table, the JSON) and ``run`` (the order, and the command). Nothing is imported here, so
that building the command line loads only ``options``.
"""
