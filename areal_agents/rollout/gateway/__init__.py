"""The gateway: live agent traffic captured for training (issue 48)."""
