"""`streamwarden bench`: direct vs nginx vs streamwarden on the same load, in alternated rounds.

`run` drives the scenarios, `targets` starts what is measured, `client`/`load`/`cancel`/`latency`
generate and time the traffic, `report` prints the table.
"""
