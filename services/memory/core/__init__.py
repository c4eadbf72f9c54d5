"""The memory's pure domain core: records, code normalisation, play scoring and the example policy."""
