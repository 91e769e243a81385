"""Tools that talk to live servers or produce artefacts: calibration, benchmarks, data helpers."""
