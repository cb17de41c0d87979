"""serve-tinker: the Tinker training API served locally (issue 49)."""
