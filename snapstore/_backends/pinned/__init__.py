"""pinned_host arrays per failure domain: the single-controller store."""
