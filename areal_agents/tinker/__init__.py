"""`areal-agents serve-tinker`: the Tinker REST API served on our trainers, so the unmodified `tinker` SDK
and tinker-cookbook recipes run against a local machine (issue 49; docs: the protocol in wire.py, schemas.py)."""
