"""jaxcomm's implementations; the public names are in ``jaxcomm`` and its namespaces."""
