"""The trace simulator behind `prefixstore simulate`: traces, generators, policy bundles."""
