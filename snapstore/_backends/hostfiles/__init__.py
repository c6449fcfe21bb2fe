"""Host files on a RAM disk: the multi-controller store."""
