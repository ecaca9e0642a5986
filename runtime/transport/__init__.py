"""Mooncake data plane: master lifecycle, store client, sample keys, cursor, watermarks."""
