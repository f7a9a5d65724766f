"""jaxcomm training programs."""
