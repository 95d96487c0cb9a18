"""The node's memory tier for training state (ftd_client.checkpoint's daemon side)."""
